"""README's example outputs are the real CLI's (its headline plan showed 949.9 ms / bound
842.6 ms against the CLI's 935.0 / 924.7 ms): `docs/readme_outputs.py --check` reruns every
`$ elastic-refit ...` block of README and compares. When it fails, run
`python docs/readme_outputs.py` and commit README."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_example_outputs_are_what_the_cli_prints():
    text = (ROOT / "README.md").read_text()
    assert text.count("```\n$ elastic-refit ") >= 1, "README shows no CLI output: the check would pass vacuously"
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "readme_outputs.py"), "--check"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
