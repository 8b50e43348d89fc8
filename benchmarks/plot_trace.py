"""A trace written by `elastic-refit timeline` (or bench_rl_step.py) as a picture.

    python benchmarks/plot_trace.py trace.json -o trace.png [--job SUFFIX] [--from S --to S]

One row per member incarnation (and the job's rows): its slices as bars, coloured by kind
(generate, train, transfer, serving pause, attempt, recovery, ...), faults as red lines.
``--job`` keeps the slices of the job whose name ends with SUFFIX (e.g. ``async-staged``)
plus the loop's own (``rl.*``). Needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys

COLOURS = {"rl.generate": "#4c9be8", "rl.train": "#f5a623", "rl.publish": "#9b59b6", "rl.gather_broadcast": "#9b59b6",
           "refit.transfer.done": "#2ecc71", "refit.serving.paused": "#e74c3c", "attempt": "#d5f5e3",
           "recovery": "#fadbd8", "epoch": "#eeeeee", "version": "#d6eaf8"}


def _colour(event: dict) -> str | None:
    name = event["name"].split(" v")[0].split(" e")[0]
    return COLOURS.get(name) or COLOURS.get(event.get("cat", ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--job", default=None, help="keep this job's slices (name suffix) and the loop's own")
    p.add_argument("--from", dest="start", type=float, default=None, help="seconds from the trace's start")
    p.add_argument("--to", dest="end", type=float, default=None)
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.trace) as fh:
        events = json.load(fh)["traceEvents"]
    names = {(e["pid"], e.get("tid", 0)): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}

    def keep(e: dict) -> bool:
        job = str(e.get("args", {}).get("job", ""))
        return args.job is None or not job or job.endswith(args.job) or e["name"].startswith("rl.")

    slices = [e for e in events if e["ph"] == "X" and _colour(e) and keep(e)]
    faults = [e for e in events if e["ph"] == "i" and e.get("cat") == "fault" and e.get("s") == "g"]
    # The job's own slices set the window (the loop's rl.* slices of other jobs fall outside).
    own = [e for e in slices if args.job is None or str(e.get("args", {}).get("job", "")).endswith(args.job)] or slices
    lo = args.start * 1e6 if args.start is not None else min(e["ts"] for e in own)
    hi = args.end * 1e6 if args.end is not None else max(e["ts"] + e["dur"] for e in own)
    slices = [e for e in slices if e["ts"] + e["dur"] >= lo and e["ts"] <= hi]
    # Wide backgrounds (attempts, epochs, versions, recovery) first, the loop's phases over them.
    slices.sort(key=lambda e: e.get("cat") not in ("attempt", "epoch", "version", "recovery"))
    rows = sorted({(e["pid"], e["tid"]) for e in slices})
    fig, ax = plt.subplots(figsize=(14, 0.45 * len(rows) + 1.5))
    for y, row in enumerate(rows):
        for e in (e for e in slices if (e["pid"], e["tid"]) == row):
            width = max(e["dur"], (hi - lo) * 0.0015)  # a 0.2 ms pause stays visible
            # The runtime's slices (transfers, pauses) on a lane below the loop's own: they overlap.
            lane = 0.28 if e["name"].startswith("refit.") else 0.0
            height = 0.3 if lane else (0.8 if e.get("cat") in ("attempt", "epoch", "version", "recovery") else 0.5)
            ax.barh(y + lane - (0.1 if not lane else 0), width / 1e6, left=(e["ts"] - lo) / 1e6, color=_colour(e),
                    edgecolor="none", height=height)
    for f in faults:
        if lo <= f["ts"] <= hi:
            ax.axvline((f["ts"] - lo) / 1e6, color="red", lw=1.5)
            ax.text((f["ts"] - lo) / 1e6, -0.9, f["name"], color="red", fontsize=8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{procs.get(pid, pid)} / {names.get((pid, tid), tid)}" for pid, tid in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, list(COLOURS), fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"{args.output}: {len(slices)} slices, {len(rows)} rows, {len(faults)} faults")
    return 0


if __name__ == "__main__":
    sys.exit(main())
