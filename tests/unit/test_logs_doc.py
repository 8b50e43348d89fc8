"""docs/LOGS.md lists every event the library logs (users build dashboards on these names)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOG_CALL = re.compile(r'\b(?:log|_log|logger)\.(?:info|warning|error|exception|debug)\(\s*"([a-z_]+\.[a-z_.]+)"')


def test_every_library_event_is_documented():
    documented = set(re.findall(r"^\| `([a-z_.]+)`", (ROOT / "docs" / "LOGS.md").read_text(), re.MULTILINE))
    logged = {}
    for folder in ("elastic_refit", "membership", "chaos", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in LOG_CALL.findall(path.read_text()):
                logged.setdefault(name, path.relative_to(ROOT))
    assert logged, "no log calls found: the pattern is stale"
    missing = {name: str(path) for name, path in logged.items() if name not in documented}
    assert not missing, f"events missing from docs/LOGS.md: {missing}"


def _resolve(dotted: str) -> object:
    """The object a dotted name names: the longest importable module prefix, then attributes."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_set_up_the_logs_doc_shows_runs_and_every_name_it_gives_exists():
    """The doc's code blocks are executed and every `elastic_refit.*` name it spells resolves
    (it named `elastic_refit.runtime.logging.configure_logging` and
    `membership.log.configure_json_logging`, neither of which existed)."""
    import structlog

    text = (ROOT / "docs" / "LOGS.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    assert blocks, "docs/LOGS.md shows no set-up code"
    try:
        for block in blocks:
            exec(compile(block, "docs/LOGS.md", "exec"), {})
    finally:
        structlog.reset_defaults()
    # (event names such as `membership.lease.lost` look like module paths; code is under elastic_refit.)
    names = set(re.findall(r"`(elastic_refit\.[A-Za-z_.]+)(?:\(\))?`", text))
    assert any(n.startswith("elastic_refit.log.") for n in names), names
    for name in sorted(names):
        _resolve(name)
