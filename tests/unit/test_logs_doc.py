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
