"""README's example outputs, produced by the real CLI: `python docs/readme_outputs.py` rewrites
every README block that starts with `$ elastic-refit ...` with what that command prints now;
`--check` only compares (exit 1 and a diff when README is stale; a test runs it).

Rows whose values are timings of this machine (layout build time, plan time) are left out of
the blocks, so the outputs are the same on every run; the rest is the command's stdout as is.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shlex
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"```\n(\$ elastic-refit [^\n]*)\n(.*?)```", re.DOTALL)
VARYING = ("layout build time", "plan time")


def command_output(command_line: str) -> str:
    """What ``command_line`` (``$ elastic-refit ...``) prints on stdout, timing rows left out."""
    argv = shlex.split(command_line.removeprefix("$ "))
    proc = subprocess.run([sys.executable, "-m", "elastic_refit.cli", *argv[1:]], capture_output=True, text=True,
                          timeout=600, check=True)
    return "".join(line + "\n" for line in proc.stdout.splitlines() if not line.startswith(VARYING))


def render(text: str) -> str:
    """README with every `$ elastic-refit` block's output replaced by the command's own."""
    return BLOCK.sub(lambda m: f"```\n{m.group(1)}\n{command_output(m.group(1))}```", text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when README is stale")
    args = parser.parse_args(argv)
    old = README.read_text()
    new = render(old)
    if args.check:
        diff = list(difflib.unified_diff(old.splitlines(), new.splitlines(), "README.md", "the CLI now", lineterm=""))
        print("\n".join(diff) if diff else "README's example outputs are the CLI's")
        return 1 if diff else 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
