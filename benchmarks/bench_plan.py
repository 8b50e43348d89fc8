"""Plan time at full scale (a benchmark, not a test).

    .venv/bin/python benchmarks/bench_plan.py [--repeat 3] [--cpu N] [--json]
        [--relay auto|on|off] [--domain-size 8] [--baseline DIR]

``--relay`` plans with ``PlanOptions(relay=...)`` (default: the planner's default options,
``"auto"``); ``--domain-size`` sets the ranks per
NVLink domain (72: GB200 NVL72); ``--baseline DIR`` also runs every repeat against the
planner of another checkout (e.g. ``git worktree add --detach /tmp/head HEAD``), with its
default options, interleaved with the new one's in the same run, and shows both cold-plan
times side by side with their ratio.

For each case, every repeat runs in a fresh subprocess pinned to one core
(``os.sched_setaffinity``) so that "cold" really is the first ``make_plan`` of a process
(imports done, no planner caches) and the other core's noise stays out. One repeat
measures, in order:

- layout build: ``model_refit_spec`` (both sides and the topology);
- cold plan: the first ``make_plan``;
- warm plan: ``make_plan`` again on the same inputs;
- re-plan: ``destination.without_ranks([r])`` for the first destination rank, then
  ``make_plan`` in the same process (what the runtime does after losing a member). The
  derived layout copies every column of the kept ranks and inherits what its parent
  memoised during the cold plan and still holds for it (per-rank digests of the
  fingerprint, tensor layout groups as a hint that is re-verified, no-overlap, ranks,
  nbytes); the planner itself starts from scratch, so the figure covers deriving the
  layout and everything the planner does after the membership change.

The table shows medians over repeats, the plan's size (rows, expanded transfers, tensor
classes) and cross-domain bytes / lower bound (must be 1.000).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = {
    "deepseek-v3": ("deepseek-v3", "pp=16,ep=16,dp=16", "tp=32,dp=8"),
    "qwen3-235b": ("qwen3-235b-a22b", "tp=4,pp=8,ep=16,dp=4", "tp=8,dp=16"),
    "kimi-k2": ("kimi-k2", "pp=16,ep=16,dp=16", "tp=16,dp=8"),
}
# Goals from the issue (DeepSeek-V3 on one core of the 2-core machine).
GOALS = {"deepseek-v3": {"cold_plan_s": 1.0, "replan_s": 0.1}}
TIMES = ("layout_s", "cold_plan_s", "warm_plan_s", "replan_s", "without_ranks_s",
         "layout_cpu_s", "cold_plan_cpu_s", "warm_plan_cpu_s", "replan_cpu_s")


def worker(case: str, cpu: int, domain_size: int = 8, relay: str | None = None) -> dict:
    """One measurement in this (fresh) process; returns the figures."""
    os.sched_setaffinity(0, {cpu})
    from elastic_refit.layout.refit import model_refit_spec
    from elastic_refit.plan import PlanOptions
    from elastic_refit.plan import make_plan as plain_make_plan

    # A baseline checkout's planner may predate the option: pass it only when asked for.
    options = PlanOptions(relay=relay) if relay else None

    def make_plan(source, destination, topology):
        return plain_make_plan(source, destination, topology, options)

    model, source, destination = CASES[case]
    # Wall and CPU time of every step: the machine is shared, and CPU time of a process
    # pinned to one core is what the step costs when it has the core to itself.
    marks = []

    def mark() -> None:
        marks.append((time.perf_counter(), time.process_time()))

    mark()
    spec = model_refit_spec(model, source, destination, domain_size=domain_size)
    mark()
    plan = make_plan(spec.source, spec.destination, spec.topology)
    mark()
    warm = make_plan(spec.source, spec.destination, spec.topology)
    mark()
    lost = spec.destination.ranks[0]
    smaller = spec.destination.without_ranks([lost])
    mark()
    replan = make_plan(spec.source, smaller, spec.topology)
    mark()
    (t0, c0), (t1, c1), (t2, c2), (t3, c3), (t4, _), (t5, c5) = marks
    assert warm.fingerprint == plan.fingerprint, "same inputs gave another plan"
    s, r = plan.stats, replan.stats
    return {
        "case": case, "model": model, "source": source, "destination": destination, "cpu": cpu,
        "num_source_ranks": s.num_source_ranks, "num_destination_ranks": s.num_destination_ranks,
        "num_source_pieces": spec.source.num_pieces, "num_destination_pieces": spec.destination.num_pieces,
        "layout_s": t1 - t0, "cold_plan_s": t2 - t1, "warm_plan_s": t3 - t2,
        "without_ranks_s": t4 - t3, "replan_s": t5 - t3,
        "layout_cpu_s": c1 - c0, "cold_plan_cpu_s": c2 - c1, "warm_plan_cpu_s": c3 - c2,
        "replan_cpu_s": c5 - c3,
        "num_rows": s.num_rows, "num_transfers": s.num_transfers, "num_tensor_classes": s.num_tensor_classes,
        "cross_over_bound": s.cross_domain_bytes / max(s.lower_bound_bytes, 1),
        "replan_cross_over_bound": r.cross_domain_bytes / max(r.lower_bound_bytes, 1),
        "removed_rank": lost, "replan_num_transfers": r.num_transfers,
        "relayed": bool(getattr(plan, "relayed", False)),
    }


def run_fresh(case: str, cpu: int, domain_size: int = 8, relay: str | None = None, tree: str | None = None) -> dict:
    """One repeat in a fresh process; ``tree``: import the planner from that checkout."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", case, "--cpu", str(cpu),
               "--domain-size", str(domain_size)] + (["--relay", relay] if relay else [])
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(Path(tree).resolve()) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env, cwd=tree or None)
    if done.returncode != 0:
        raise SystemExit(f"bench_plan: worker for {case} failed:\n{done.stderr}")
    return json.loads(done.stdout)


def summarise(case: str, runs: list[dict]) -> dict:
    out = {k: v for k, v in runs[0].items() if k not in TIMES}
    out["repeats"] = len(runs)
    for key in TIMES:
        values = [r[key] for r in runs]
        out[key] = statistics.median(values)
        out[f"{key}_all"] = values
    goals = GOALS.get(case, {})
    out["goals"] = {
        key: {"goal_s": goal, "met_wall": out[key] <= goal, "met_cpu": out[key.replace("_s", "_cpu_s")] <= goal}
        for key, goal in goals.items()
    }
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per case (default 3)")
    parser.add_argument("--cpu", type=int, default=None, help="core to pin to (default: the last allowed one)")
    parser.add_argument("--case", choices=sorted(CASES), action="append", help="only these cases")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--relay", choices=("auto", "on", "off"), default=None,
                        help="plan with PlanOptions(relay=...) (default: the planner's default options)")
    parser.add_argument("--domain-size", type=int, default=8, help="ranks per NVLink domain (default 8)")
    parser.add_argument("--baseline", metavar="DIR", help="also time the planner of this checkout (old vs new)")
    parser.add_argument("--worker", choices=sorted(CASES), help=argparse.SUPPRESS)
    return parser


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (``parser.error``) what a measuring run can't use; a worker is not checked."""
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.domain_size < 1:
        parser.error(f"--domain-size must be >= 1, got {args.domain_size}")
    if args.baseline is not None and not (Path(args.baseline) / "elastic_refit" / "plan").is_dir():
        parser.error(f"--baseline {args.baseline!r} holds no elastic_refit/plan")


def _measure(args: argparse.Namespace, cpu: int) -> tuple[dict, dict]:
    """Summaries of every case (with the baseline's times when asked), and the baseline's own."""
    from elastic_refit.cli._output import progress

    results, baseline = {}, {}
    for case in args.case or list(CASES):
        runs, old_runs = [], []
        for i in range(args.repeat):
            progress(f"{case}: fresh process {i + 1}/{args.repeat} on cpu {cpu} ...")
            runs.append(run_fresh(case, cpu, args.domain_size, args.relay))
            if args.baseline:  # interleaved, so both see the same machine
                old_runs.append(run_fresh(case, cpu, args.domain_size, None, args.baseline))
        results[case] = summarise(case, runs)
        if args.baseline:
            baseline[case] = summarise(case, old_runs)
            results[case]["baseline"] = {key: baseline[case][key] for key in TIMES}
    return results, baseline


def _cell_of(r: dict, key: str) -> str:
    """``wall / cpu`` of one step."""
    from elastic_refit.cli._output import format_seconds

    return f"{format_seconds(r[key])} / {format_seconds(r[key.replace('_s', '_cpu_s')])}"


def _cell(r: dict, key: str) -> str:
    """``wall / cpu``, and the verdict of each against the goal when there is one."""
    from elastic_refit.cli._output import format_seconds

    cpu_key = key.replace("_s", "_cpu_s")
    text = f"{format_seconds(r[key])} / {format_seconds(r[cpu_key])}"
    goal = r["goals"].get(key)
    if goal:
        verdict = "/".join("ok" if goal[m] else "MISS" for m in ("met_wall", "met_cpu"))
        text += f" [<= {format_seconds(goal['goal_s'])}: {verdict}]"
    return text


def _print_results(args: argparse.Namespace, cpu: int, results: dict) -> None:
    """The headline and the table of every case's times and plan size."""
    from elastic_refit.cli._output import render_table

    rows = []
    for case, r in results.items():
        rows.append((
            f"{case} {r['source']} -> {r['destination']}",
            f"{r['num_source_ranks']}+{r['num_destination_ranks']}",
            _cell(r, "layout_s"),
            _cell(r, "cold_plan_s"),
            _cell(r, "warm_plan_s"),
            _cell(r, "replan_s"),
            f"{r['num_rows']}/{r['num_transfers']}/{r['num_tensor_classes']}",
            f"{r['cross_over_bound']:.3f}",
        ))
    print(f"median of {args.repeat} fresh processes, each pinned to cpu {cpu}; times are wall / CPU; "
          f"domain size {args.domain_size}, relay {args.relay or 'default'}; "
          f"relayed: {', '.join(case for case, r in results.items() if r['relayed']) or 'none'}")
    print(render_table(("case", "ranks", "layout", "cold plan", "warm plan", "re-plan (-1 dst rank)",
                        "rows/transfers/classes", "cross/bound"), rows))


def _cpu_ratio(r: dict, key: str) -> str:
    """New CPU time over the baseline's, of one step ('' without a baseline)."""
    cpu_key = key.replace("_s", "_cpu_s")
    return f"{r[cpu_key] / baseline_of[cpu_key]:.2f}" if (baseline_of := r["baseline"]) else ""


def _print_baseline(args: argparse.Namespace, results: dict, baseline: dict) -> None:
    """Old and new planner side by side, with the ratio of their CPU times."""
    from elastic_refit.cli._output import render_table

    print(f"old planner: {args.baseline} (default options); ratio of CPU times, new / old")
    print(render_table(("case", "old cold plan", "new cold plan", "new / old", "old warm", "new warm",
                        "new / old", "old re-plan", "new re-plan", "new / old"), [
        (case, _cell_of(baseline[case], "cold_plan_s"), _cell_of(r, "cold_plan_s"), _cpu_ratio(r, "cold_plan_s"),
         _cell_of(baseline[case], "warm_plan_s"), _cell_of(r, "warm_plan_s"), _cpu_ratio(r, "warm_plan_s"),
         _cell_of(baseline[case], "replan_s"), _cell_of(r, "replan_s"), _cpu_ratio(r, "replan_s"))
        for case, r in results.items()]))


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
    if args.worker:
        print(json.dumps(worker(args.worker, cpu, args.domain_size, args.relay)))
        return
    _check_args(parser, args)
    results, baseline = _measure(args, cpu)
    if args.json:
        from elastic_refit.cli._output import print_json

        print_json({"cpu": cpu, "repeat": args.repeat, "relay": args.relay, "domain_size": args.domain_size,
                    "baseline": args.baseline, "cases": results})
        return
    _print_results(args, cpu, results)
    if args.baseline:
        _print_baseline(args, results, baseline)


if __name__ == "__main__":
    main()
