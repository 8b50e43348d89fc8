"""The one table of ``bash benchmarks/gpu_session.sh all``: the GPU suite's lanes and the GPU
benchmarks, read from what that step left in its output folder.

Per pytest lane ``NAME``: ``NAME.xml`` (JUnit, written even when the lane was interrupted),
``NAME.rc`` ("exit-code wall-seconds"), ``NAME.collected`` (pytest's "N tests collected"
line). A failure whose message is pytest-timeout's ("Timeout >N s"), or a pytest-xdist
worker that died under the test (pytest-timeout's thread method ends it), counts as hung; so
does every collected test of a lane cut by its deadline that never reported. Per benchmark
``NAME``: ``NAME.json`` and ``NAME.rc``.

Usage: python benchmarks/gpu_all_table.py OUT_DIR [--lanes runtime rest] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

__all__ = ["bench_rows", "lane_row", "main", "render"]

# pytest-timeout's failure (signal method), or the worker it ended (thread method: xdist
# reports the test as having crashed its worker)
_TIMEOUT = re.compile(r"Timeout \(?>\s*[\d.]+\s*s|crashed while running", re.IGNORECASE)


def _rc(path: Path) -> tuple[int | None, float | None]:
    """(exit code, wall seconds) from an ``.rc`` file; (None, None) when absent."""
    try:
        code, wall = path.read_text().split()[:2]
        return int(code), float(wall)
    except (OSError, ValueError):
        return None, None


def lane_row(out: Path, name: str) -> dict:
    """Counts of one pytest lane: collected, passed, failed, errors, hung, skipped, the wall
    time, and the ids of what failed or hung."""
    code, wall = _rc(out / f"{name}.rc")
    row: dict = {"step": name, "rc": code, "wall_s": wall, "collected": None, "passed": 0, "failed": 0,
                 "errors": 0, "hung": 0, "skipped": 0, "bad": []}
    with_count = re.search(r"(\d+) tests? collected", _read(out / f"{name}.collected"))
    if with_count:
        row["collected"] = int(with_count.group(1))
    try:
        root = ET.parse(out / f"{name}.xml").getroot()
    except (OSError, ET.ParseError):
        row["note"] = "no JUnit report (the lane did not finish)"
        if row["collected"]:
            row["hung"] = row["collected"]
        return row
    reported = 0
    for case in root.iter("testcase"):
        reported += 1
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        failure, error = case.find("failure"), case.find("error")
        if case.find("skipped") is not None:
            row["skipped"] += 1
        elif failure is not None or error is not None:
            node = failure if failure is not None else error
            text = f"{node.get('message', '')} {node.text or ''}"
            kind = "hung" if _TIMEOUT.search(text) else ("failed" if failure is not None else "errors")
            row[kind] += 1
            row["bad"].append(f"{kind}: {test_id}")
        else:
            row["passed"] += 1
    if row["collected"] is not None and reported < row["collected"]:
        missing = row["collected"] - reported
        row["hung"] += missing
        row["note"] = f"{missing} collected tests never reported (lane cut at its deadline)"
    return row


def bench_rows(out: Path) -> list[dict]:
    """One row per benchmark that ran: its exit code, wall time and key figures."""
    rows = []
    for name, figures in (("kernels", _kernels), ("lifecycle", _lifecycle), ("churn", _churn),
                          ("churn4", _churn), ("churn8", _churn)):
        code, wall = _rc(out / f"{name}.rc")
        if code is None:
            continue
        try:
            key = figures(_load_json(out / f"{name}.json"))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            key = f"no result ({type(exc).__name__})"
        rows.append({"step": f"bench {name}", "rc": code, "wall_s": wall, "key": key})
    return rows


def _kernels(doc: dict) -> str:
    g = doc["goal"]
    launches = doc.get("meta", {}).get("launches", {})
    return (f"eager >= 0.8 of copy on every row: {'yes' if g['met'] else 'NO'}; lowest p/c {g['min_pack']:.2f} "
            f"({g['worst_pack']}), u/c {g['min_unpack']:.2f} ({g['worst_unpack']}); bit-exact {g['bit_exact']}; "
            f"launches direct {launches.get('direct', '?')} / dispatch {launches.get('dispatch', '?')}")


def _lifecycle(doc: list) -> str:
    parts = []
    for r in doc:
        if "error" in r:
            parts.append(f"{r['backend']} x{r['ranks']}: error {r['error'][:80]}")
            continue
        parts.append(f"{r['backend']} x{r['ranks']}: " + ", ".join(
            f"{p} {r[p + '_p50_s']:.3f}" for p in ("shrink", "grow", "rebuild") if r.get(p + "_p50_s") is not None))
    return "; ".join(parts) + " (p50 s)"


def _churn(doc: dict) -> str:
    parts = []
    for label in ("shrink", "grow", "rebuild"):
        row = doc.get(label)
        if row and row.get("ratio") is not None:
            parts.append(f"{label}: first {row['first_s']:.3f} / steady p50 {row['steady_p50_s']:.3f} s = "
                         f"{row['ratio']:.2f}x")
    parts.append("oracle passed" if doc.get("passed") else f"oracle FAILED {doc.get('violations')}")
    return "; ".join(parts)


def _load_json(path: Path):
    """The JSON document a benchmark printed, also when other lines (a child's log, NCCL's
    banner) came before it on stdout: parsed from the first line that opens one."""
    text = path.read_text()
    try:
        return json.loads(text)
    except ValueError:
        pass
    decoder = json.JSONDecoder()
    offset = 0
    for line in text.splitlines(keepends=True):
        if line[:1] in ("{", "["):
            try:
                return decoder.raw_decode(text, offset)[0]
            except ValueError:
                pass
        offset += len(line)
    raise ValueError(f"no JSON document in {path}")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _cell(v) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if isinstance(v, float) else str(v)


def render(lanes: list[dict], benches: list[dict], total_s: float | None = None) -> str:
    """The table (markdown), then what failed or hung, one line each."""
    lines = ["| step | collected | passed | failed | errors | hung | skipped | rc | wall s | key figures |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in lanes:
        cells = [r["step"], *(_cell(r[k]) for k in ("collected", "passed", "failed", "errors", "hung", "skipped",
                                                    "rc", "wall_s")), r.get("note", "")]
        lines.append("| " + " | ".join(cells) + " |")
    if lanes:
        tot = {k: sum(r[k] or 0 for r in lanes) for k in ("collected", "passed", "failed", "errors", "hung", "skipped")}
        wall = max((r["wall_s"] or 0 for r in lanes), default=0)
        lines.append("| **GPU suite** | " + " | ".join(str(tot[k]) for k in tot)
                     + f" | - | {wall:.0f} | lanes side by side |")
    for b in benches:
        lines.append(f"| {b['step']} | | | | | | | {_cell(b['rc'])} | {_cell(b['wall_s'])} | {b['key']} |")
    if total_s is not None:
        lines.append(f"| **all** | | | | | | | | {total_s:.0f} | |")
    bad = [f"- {r['step']}: {b}" for r in lanes for b in r["bad"]]
    return "\n".join(lines + ([""] + bad if bad else []))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="the output folder of gpu_session.sh all")
    ap.add_argument("--lanes", nargs="+", default=["runtime", "rest"])
    ap.add_argument("--total-s", type=float, default=None, help="the whole step's wall seconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    lanes = [lane_row(out, name) for name in args.lanes if (out / f"{name}.rc").exists()]
    benches = bench_rows(out)
    if args.json:
        print(json.dumps({"lanes": lanes, "benches": benches, "total_s": args.total_s}, indent=1))
    else:
        print(render(lanes, benches, args.total_s))
    clean = all(r["failed"] == r["errors"] == r["hung"] == 0 and r["rc"] == 0 for r in lanes)
    return 0 if clean and all(b["rc"] == 0 for b in benches) else 1


if __name__ == "__main__":
    sys.exit(main())
