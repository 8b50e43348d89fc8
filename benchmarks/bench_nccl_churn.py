"""Does the reshard win survive churn? The first refit after a shrink and the first after a
grow, each against the steady-state refit of the same layout, in the same run.

A real job (etcd, 2 trainer replicas, 4 inference ranks as 2 x TP=2; ``--ranks`` 4 or 8 in all;
every member on the GPU as a host of its own to NCCL) publishes ``--versions`` versions of a transformer-shaped
model. At version ``--kill-at`` an inference rank is SIGKILLed: by default between refits
(``--kill-phase ack.before``: its bytes arrived, no transfer in flight), so the survivors
shrink the communicator; with ``--kill-phase transfer`` during a transfer, which leaves the
survivors' NCCL communicators in an error state, so the epoch is a rebuild. Once its lease
expired the rank comes back as a new incarnation (the communicator grows, the rank catches
up from its peers). ``--no-connect-ahead`` turns off connecting the plan's pairs on entering
an epoch (``RefitConfig.connect_ahead``), to see what the first refit pays without it. Each inference rank's
transfer seconds come from its ``refit.transfer.done`` events; each epoch's communicator
path from ``comm.reconfigured``. NeMo RL's shrink demo for comparison: 2.1 s before, 3.7 s
right after a shrink.

    python benchmarks/bench_nccl_churn.py --backend nccl4py [--versions 22] [--no-connect-ahead] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Any

import numpy as np


def churn_scenario(num_versions: int, kill_at: int, hidden: int, num_layers: int, vocab: int, *,
                   kill_phase: str = "ack.before", connect_ahead: bool = True, num_inference: int = 4,
                   inference_tp: int = 2):
    from elastic_refit.chaos.faults import TTL_S, FaultPlan, Scenario

    from elastic_refit.testing.specs import demo_spec

    chunk = {"chunk": 1} if kill_phase == "transfer" else {}
    plan = FaultPlan().kill(role="inference", rank=1, at=kill_phase, version=kill_at, restart=True,
                            restart_delay_s=TTL_S + 1.5, **chunk)
    spec = demo_spec(num_inference, inference_tp, hidden=hidden, num_layers=num_layers, vocab=vocab)
    return Scenario(name="churn", victim="inference", fault="kill+rejoin", phase=kill_phase, plan=plan, seed=0,
                    versions=num_versions, num_inference=num_inference, spec_json=json.dumps(spec), trainer_pause_s=0.2,
                    member_config={"bucket_bytes": 16 << 20, "staging_bytes": 64 << 20,
                                   "version_timeout_s": 120.0,
                                   "connect_ahead": "on" if connect_ahead else "off"})


def refit_times(logs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per epoch: its communicator path and the slowest inference rank's transfer seconds of
    every version refit in it (a refit ends when its slowest rank's bytes arrived)."""
    paths: dict[int, set[str]] = defaultdict(set)
    seconds: dict[tuple[int, int], float] = {}
    connect: dict[int, float] = {}  # epoch -> slowest rank's connect-ahead seconds
    by_member: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
    # The executor logs its phases just before the runtime's transfer.done names the epoch
    # and version: the slowest rank's phases say where a first refit's extra time goes.
    phases: dict[tuple[int, int], dict[str, float]] = {}
    for incarnation, events in logs.items():
        last_phases: dict[str, float] = {}
        for e in events:
            if e.get("event") == "transport.executor.done":
                last_phases = {k[len("phase_"):-2]: float(v) for k, v in e.items()
                               if k.startswith("phase_") and k.endswith("_s")}
            if e.get("event") == "comm.reconfigured":
                paths[int(e["epoch"])].add(str(e["path"]))
            if e.get("event") == "refit.connect.done" and "epoch" in e:
                connect[int(e["epoch"])] = max(connect.get(int(e["epoch"]), 0.0), float(e["seconds"]))
            if (e.get("event") == "refit.transfer.done" and e.get("role") == "inference" and "epoch" in e
                    and e.get("kind") == "refit"):
                key = (int(e["epoch"]), int(e["version"]))
                if float(e["seconds"]) >= seconds.get(key, 0.0):
                    phases[key] = last_phases
                seconds[key] = max(seconds.get(key, 0.0), float(e["seconds"]))
                by_member[key][incarnation] = round(float(e["seconds"]), 3)
    return {"paths": {k: sorted(v) for k, v in paths.items()}, "seconds": seconds, "connect": connect,
            "by_member": by_member, "phases": phases}


def summarize(times: dict[str, Any]) -> dict[str, Any]:
    """The first refit of the first epoch after a shrink (and after a grow) against the
    steady state of the same layout: the later refits of that same epoch (same members,
    same plan shape, warm communicator)."""
    paths, seconds = times["paths"], times["seconds"]
    by_epoch: dict[int, list[float]] = defaultdict(list)
    for (epoch, _version), s in sorted(seconds.items()):
        by_epoch[epoch].append(s)
    out: dict[str, Any] = {"epochs": {str(k): v for k, v in sorted(paths.items())},
                           "refits": {str(k): v for k, v in sorted(by_epoch.items())},
                           "connect_ahead_s": {str(k): v for k, v in sorted(times.get("connect", {}).items())}}
    for label, wanted in (("shrink", {"shrink", "shrink_abort"}), ("grow", {"grow"}), ("rebuild", {"rebuild"})):
        epochs = [e for e in sorted(paths) if set(paths[e]) & wanted and len(by_epoch.get(e, ())) >= 2]
        if epochs:
            first, *rest = by_epoch[epochs[0]]
            steady = float(np.median(rest))
            versions = sorted(v for e, v in seconds if e == epochs[0])
            out[label] = {"epoch": epochs[0], "first_s": first, "steady_p50_s": steady, "num_steady": len(rest),
                          "ratio": first / steady if steady else None,
                          "first_by_member": dict(times.get("by_member", {}).get((epochs[0], versions[0]), {})),
                          "phases": phase_table(times.get("phases", {}), epochs[0], versions)}
    return out


def phase_table(phases: dict[tuple[int, int], dict[str, float]], epoch: int,
                versions: list[int]) -> dict[str, dict[str, float]]:
    """The slowest rank's seconds per executor phase: the epoch's first refit against the
    median of its later ones."""
    first = phases.get((epoch, versions[0]), {})
    rest = [phases[(epoch, v)] for v in versions[1:] if (epoch, v) in phases]
    names = sorted(set(first).union(*rest)) if rest else sorted(first)
    return {name: {"first_s": round(first.get(name, 0.0), 4),
                   "steady_p50_s": round(float(np.median([r.get(name, 0.0) for r in rest])), 4) if rest else None}
            for name in names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="nccl4py", choices=["gloo", "nccl", "nccl4py"])
    parser.add_argument("--versions", type=int, default=22,
                        help="versions published (default 22: the rank killed at --kill-at rejoins after its "
                             "lease TTL, and the grown epoch still runs several refits)")
    parser.add_argument("--kill-at", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--kill-phase", default="ack.before", choices=["ack.before", "transfer"])
    parser.add_argument("--no-connect-ahead", dest="connect_ahead", action="store_false")
    parser.add_argument("--ranks", type=int, default=6, choices=(4, 6, 8),
                        help="members in all: 2 trainers and 2 (TP 1), 4 (2 x TP 2) or 6 (3 x TP 2) inference ranks")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 2 <= args.kill_at < args.versions - 2:
        parser.error(f"--kill-at must leave steady refits before it and refits after the rejoin, got "
                     f"{args.kill_at} of {args.versions}")

    from elastic_refit.chaos.runner import ChaosRun

    run = ChaosRun(deadline_s=300.0, backend=args.backend, keep_logs=False)
    try:
        print(f"churn on {args.backend}, {args.ranks} ranks: {args.versions} versions, inference rank i1 killed at "
              f"{args.kill_phase} "
              f"of v{args.kill_at} and back after its lease, connect ahead {args.connect_ahead} ...", file=sys.stderr)
        num_inference = args.ranks - 2
        scenario = churn_scenario(args.versions, args.kill_at, args.hidden, args.layers, args.vocab,
                                  kill_phase=args.kill_phase, connect_ahead=args.connect_ahead,
                                  num_inference=num_inference, inference_tp=1 if num_inference < 4 else 2)
        result = run.run_trial(scenario, narrate=lambda m: print(m, file=sys.stderr))
    finally:
        leaked = run.close()
    out = summarize(refit_times(result.evidence.logs))
    out.update(backend=args.backend, ranks=args.ranks, kill_phase=args.kill_phase, connect_ahead=args.connect_ahead,
               passed=result.verdict.passed, leaked_pids=leaked,
               violations=[f"{v.category}: {v.detail}" for v in result.verdict.violations],
               recovery_s=list(result.verdict.recovery_s))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        def fmt(v):
            return "-" if v is None else f"{v:.3f}"
        print(f"{'after':8} {'epoch':>5} {'first refit s':>13} {'steady p50 s':>12} {'ratio':>6}")
        for label in ("shrink", "grow", "rebuild"):
            if label in out:
                row = out[label]
                print(f"{label:8} {row['epoch']:>5} {fmt(row['first_s']):>13} {fmt(row['steady_p50_s']):>12} "
                      f"{fmt(row['ratio']):>6}")
                print("         phases (first / steady p50 s): " + ", ".join(
                    f"{name} {p['first_s']:.3f}/{fmt(p['steady_p50_s'])}" for name, p in row["phases"].items()))
        print(f"epochs and paths: {out['epochs']}; oracle: {'passed' if out['passed'] else out['violations']}")
    return 0 if out["passed"] and not leaked else 1


if __name__ == "__main__":
    sys.exit(main())
