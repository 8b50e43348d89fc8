"""The public surface: ``elastic_refit.__all__`` (and ``elastic_refit.transport.__all__``)
resolve, are declared for type checkers, stay lazy (planning loads no etcd/gRPC client), and
README's code examples import only public names."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import elastic_refit
import elastic_refit.transport

REPO_ROOT = Path(__file__).resolve().parents[2]
# Modules whose ``__all__`` is the public API (README's examples import from these only).
PUBLIC_MODULES = ("elastic_refit", "elastic_refit.transport")


def _module_source(module) -> ast.Module:
    return ast.parse(Path(module.__file__).read_text())


def _literal_all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return ast.literal_eval(node.value)  # a literal list, not computed
    raise AssertionError("no __all__ assignment")


def _type_checking_imports(tree: ast.Module) -> dict[str, str]:
    """name -> module of every import under ``if TYPE_CHECKING:``."""
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom), ast.dump(stmt)
                for alias in stmt.names:
                    names[alias.asname or alias.name] = stmt.module  # type: ignore[assignment]
    return names


@pytest.mark.parametrize("module", [elastic_refit, elastic_refit.transport], ids=lambda m: m.__name__)
def test_every_exported_name_resolves_and_is_declared(module):
    tree = _module_source(module)
    exported = _literal_all(tree)
    assert exported == sorted(exported) and len(set(exported)) == len(exported)
    assert exported == module.__all__
    declared = _type_checking_imports(tree)
    names = [n for n in exported if n != "__version__"]
    # Type checkers see every exported name, from the module it is lazily imported from.
    assert declared == {n: module._EXPORTS[n] for n in names}
    assert set(module._EXPORTS) == set(names)
    for name in exported:
        value = getattr(module, name)
        assert value is not None, name
        if name in module._EXPORTS:
            assert value is getattr(importlib.import_module(module._EXPORTS[name]), name), name
    assert set(exported) <= set(dir(module))
    with pytest.raises(AttributeError, match="no attribute 'not_exported'"):
        module.not_exported  # noqa: B018


def test_runtime_faults_are_refit_errors():
    for name in ("MembershipLost", "PlanMismatch", "TransportAborted", "VerificationFailed",
                 *(n for n in ("RefitFailed", "RefitTimeout") if n in elastic_refit.__all__)):
        assert issubclass(getattr(elastic_refit, name), elastic_refit.RefitError), name
    # The membership layer raises the very same class.
    from elastic_refit.membership import MembershipLost

    assert MembershipLost is elastic_refit.MembershipLost


def test_planning_imports_no_etcd_or_grpc_client():
    code = (
        "import sys\n"
        "import elastic_refit\n"
        "make_plan = elastic_refit.make_plan\n"
        "src, dst = elastic_refit.LayoutBuilder(), elastic_refit.LayoutBuilder()\n"
        "elastic_refit.add_sharded_tensor(src, 'w', (8, 4), 'float32', [0, 1], ['S(0)'])\n"
        "elastic_refit.add_sharded_tensor(dst, 'w', (8, 4), 'float32', [2, 3], ['S(1)'])\n"
        "make_plan(src.build(), dst.build(), elastic_refit.Topology.uniform(4, domain_size=2))\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'aetcd', 'grpc', 'etcd3'}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def _readme_python_blocks() -> list[str]:
    text = (REPO_ROOT / "README.md").read_text()
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_examples_import_only_public_names():
    blocks = _readme_python_blocks()
    assert blocks, "README has no python code blocks"
    imported = []
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "elastic_refit":
                assert node.module in PUBLIC_MODULES, f"README imports from {node.module}"
                public = importlib.import_module(node.module).__all__
                for alias in node.names:
                    assert alias.name in public, f"README imports {alias.name} from {node.module}"
                    imported.append(alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "elastic_refit":
                        assert alias.name in PUBLIC_MODULES, f"README imports {alias.name}"
    assert {"make_plan", "Executor", "C10dTransport", "ElasticRefit"} <= set(imported)
