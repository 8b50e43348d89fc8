"""The runtime stays readable (issue 33): its modules, functions and classes are small, and
no thread waits on a condition by polling it on a constant timer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RUNTIME = Path(__file__).resolve().parents[2] / "elastic_refit" / "runtime"
MODULES = sorted(RUNTIME.glob("*.py"))
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_MUTABLE_ATTRIBUTES = 15


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    """Attributes a class's methods assign on ``self`` (its mutable state)."""
    names = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                    and target.value.id == "self":
                names.add(target.attr)
    return names


def _is_frozen(cls: ast.ClassDef) -> bool:
    for deco in cls.decorator_list:
        if isinstance(deco, ast.Call) and any(k.arg == "frozen" and getattr(k.value, "value", False)
                                              for k in deco.keywords):
            return True
    return False


def test_there_are_modules_to_check():
    assert len(MODULES) >= 10, MODULES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_module_is_small(path):
    assert len(path.read_text().splitlines()) <= MAX_MODULE_LINES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_functions_are_short(path):
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(_tree(path))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_classes_own_little_mutable_state(path):
    big = {}
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ClassDef) and not _is_frozen(node):
            attributes = _self_attributes(node)
            if len(attributes) > MAX_MUTABLE_ATTRIBUTES:
                big[node.name] = sorted(attributes)
    assert big == {}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_condition_is_polled_on_a_constant_timer(path):
    """``x.wait(0.05)`` inside a loop is a poll: wait on the condition that says what changed."""
    polls = []
    for loop in ast.walk(_tree(path)):
        if not isinstance(loop, ast.While | ast.For):
            continue
        for node in ast.walk(loop):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("wait", "wait_for") and node.args \
                    and isinstance(node.args[-1], ast.Constant):
                polls.append(node.lineno)
    assert polls == []


def test_the_checks_can_fail():
    """The checks above see what they look for (a poll, a long function, a crowded class)."""
    poll = ast.parse("while True:\n    cond.wait(0.05)\n")
    assert any(isinstance(n, ast.Call) and isinstance(n.args[-1], ast.Constant)
               for loop in ast.walk(poll) if isinstance(loop, ast.While) for n in ast.walk(loop))
    crowded = ast.parse("class C:\n    def __init__(self):\n" +
                        "".join(f"        self.a{i} = {i}\n" for i in range(16)))
    assert len(_self_attributes(crowded.body[0])) == 16
    frozen = ast.parse("@dataclass(frozen=True)\nclass F:\n    x: int\n")
    assert _is_frozen(frozen.body[0])
