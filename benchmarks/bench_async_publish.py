"""Does the refit hide under the training step? ``publish`` waiting for each commit against
``publish(..., wait=False)``, side by side in one run (a benchmark, not a test).

A real etcd, 2 trainer replicas and 4 inference ranks (2 x TP=2) as processes, a small
transformer-shaped model (``--hidden``). Each trainer step is a sleep of ``--step-s`` (a training
step runs on the GPU, not on these CPUs), then new weights (copied in, made before the loop),
then publish. Waiting, an
iteration costs the step plus the refit; without waiting (a snapshot copy within
``snapshot_bytes``, or ``--hold`` for hold-until-sent) the next step runs while the version
moves. Every version commits only once every inference rank acked it with verified digests
(of what the sources published); the inference ranks check the last version byte for byte
(checking each one here would compete with the refit for these two CPUs).

    .venv/bin/python benchmarks/bench_async_publish.py [--versions 8] [--step-s 0.5] [--hold] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid

import numpy as np


def run_job(endpoints: tuple[str, ...], spec: str, versions: tuple[int, ...], step_s: float, async_publish: bool,
            snapshot_bytes: int) -> dict:
    import os

    from elastic_refit.testing.job import MemberSpec
    from elastic_refit.testing.processes import fork_server_context
    from elastic_refit.testing.soak import _member_main

    job = f"async-{uuid.uuid4().hex[:6]}"
    ctx = fork_server_context()
    results = ctx.Queue()
    members = [("trainer", "t0", 0), ("trainer", "t1", 1)] + [("inference", f"i{k}", 2 + k) for k in range(4)]
    everyone = tuple(m for _, m, _ in members)
    config = {"bucket_bytes": 16 << 20, "staging_bytes": 64 << 20, "snapshot_bytes": snapshot_bytes}
    procs = []
    t0 = time.monotonic()
    for role, member_id, rank in members:
        spec_member = MemberSpec(job, role, member_id, rank, endpoints, f"d-{role}", spec_json=spec,
                                 versions=versions, pause_s=step_s if role == "trainer" else 0.0,
                                 start_with=everyone if role == "trainer" else (), async_publish=async_publish,
                                 weights_ahead=True, check_last_only=True,
                                 config=config)
        p = ctx.Process(target=_member_main, args=(spec_member, results, dict(os.environ)), daemon=True)
        p.start()
        procs.append(p)
    reports = {}
    while len(reports) < len(procs):
        r = results.get(timeout=600)
        reports[r["member_id"]] = r
    for p in procs:
        p.join(30)
    errors = {m: r["error"] for m, r in reports.items() if "error" in r}
    if errors:
        raise RuntimeError(f"members failed: {errors}")
    return {"reports": reports, "wall_s": time.monotonic() - t0}


def summarize(job: dict, versions: tuple[int, ...]) -> dict:
    """One job's figures: the trainer loop's seconds (every step and every commit), the
    median publish -> commit seconds, and whether every version committed verified."""
    trainer = job["reports"]["t0"]
    problems = sum(len(job["reports"][f"i{k}"]["problems"]) for k in range(4))
    return {"verified": [c["version"] for c in trainer["committed"]] == list(versions) and problems == 0,
            "loop_s": float(trainer["loop_s"]),
            "refit_p50_s": float(np.median([c["seconds"] for c in trainer["committed"]]))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=8)
    parser.add_argument("--step-s", type=float, default=0.5, help="seconds of one simulated training step")
    parser.add_argument("--hold", action="store_true", help="no snapshot copy: hold until sent")
    parser.add_argument("--hidden", type=int, default=512, help="model width (2 layers, vocab 4x)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.versions < 3:
        parser.error("--versions must be >= 3")

    from elastic_refit.testing.etcd import EtcdServer
    from elastic_refit.testing.specs import demo_spec

    spec = json.dumps(demo_spec(4, hidden=args.hidden, num_layers=2, vocab=4 * args.hidden))
    versions = tuple(range(1, args.versions + 1))
    out = {}
    with EtcdServer(name="async-bench") as etcd:
        for mode in ("wait", "no_wait", "wait", "no_wait"):  # twice each, interleaved against drift
            print(f"{mode}: {args.versions} versions, {args.step_s} s steps ...", file=sys.stderr)
            job = run_job(tuple(etcd.endpoints), spec, versions, args.step_s, mode == "no_wait",
                          0 if args.hold else 256 << 20)
            out.setdefault(mode, []).append(summarize(job, versions))
    result: dict = {}
    for mode, rows in out.items():
        result[mode] = {"loop_s": [r["loop_s"] for r in rows], "refit_p50_s": [r["refit_p50_s"] for r in rows],
                        "verified": all(r["verified"] for r in rows)}
    result["speedup"] = float(np.mean(result["wait"]["loop_s"]) / np.mean(result["no_wait"]["loop_s"]))
    result["steps_only_s"] = args.versions * args.step_s
    result.update(versions=args.versions, step_s=args.step_s, hold=args.hold)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{args.versions} versions, {args.step_s} s training steps, "
              f"{'hold until sent' if args.hold else 'snapshot copy'}")
        print(f"{'publish':10} {'trainer loop s (2 runs)':>24} {'publish->commit p50 s':>22} {'verified':>9}")
        for mode in ("wait", "no_wait"):
            r = result[mode]
            walls = ", ".join(f"{w:.2f}" for w in r["loop_s"])
            refits = ", ".join(f"{w:.3f}" for w in r["refit_p50_s"])
            print(f"{mode:10} {walls:>24} {refits:>22} {r['verified']!s:>9}")
        print(f"the steps alone: {result['steps_only_s']:.2f} s; speedup from not waiting: {result['speedup']:.2f}x")
    return 0 if result["wait"]["verified"] and result["no_wait"]["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
