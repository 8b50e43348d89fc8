"""Communicator reconfiguration on NCCL: shrink, grow and rebuild, each timed to the first
completed collective on the new communicator, in the same run.

N ranks (processes) run ``CommunicatorManager`` against a real etcd (rendezvous and unique
ids go through the epoch's etcd store). One cycle per repeat:

1. shrink: the last rank leaves (it aborts its own communicator and stops taking part);
   the survivors move to the next epoch with ``shrink_abort`` (a peer is gone);
2. grow: the leaver comes back as a new incarnation (additions only): ``grow`` where the
   library allows (nccl4py on NCCL >= 2.29.2), else a rebuild;
3. rebuild: a member asks for a new communicator with the same members (``reform``):
   every rank aborts and rebuilds.

Each phase is timed on every rank from a common start (a barrier) to the end of its first
vote on the new transport; the phase's figure is the slowest rank. With one GPU every rank
is a host of its own (``NCCL_HOSTID``) on the socket transport over loopback.

    python benchmarks/bench_nccl_lifecycle.py --ranks 4 8 --repeat 10 --backend nccl4py [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import numpy as np


def _barrier(store, name: str, rank: int, world_size: int) -> None:
    store.set(f"{name}/{rank}", "1")
    store.wait([f"{name}/{r}" for r in range(world_size)], timedelta(seconds=120))


def lifecycle_rank(rank: int, world_size: int, store, endpoint: str, job: str, backend: str,
                   repeat: int) -> dict[str, Any]:
    """One rank of the benchmark; returns its seconds per phase and the paths taken."""
    import torch
    from elastic_refit.membership import CommunicatorManager, EtcdClient, MembershipConfig
    from elastic_refit.membership.view import MemberRecord, MembershipView

    if backend == "gloo":  # a CPU rehearsal of the same cycle (every path is a rebuild)
        device = "cpu"
    else:
        device = f"cuda:{os.environ.get('ELASTIC_REFIT_CUDA_DEVICE', '0')}"
        torch.cuda.set_device(device)
    client = EtcdClient([endpoint])
    manager = CommunicatorManager(client, job, f"m{rank}", backend=backend, device=device,
                                  config=MembershipConfig(ttl_s=5, collective_timeout_s=4.0, epoch_deadline_s=60.0))
    last = world_size - 1

    def record(member: int, life: int, reform: int = 0) -> MemberRecord:
        return MemberRecord("trainer", f"m{member}", f"m{member}-L{life}", f"host{member}", f"d{member}",
                            device, reform=reform)

    out: dict[str, list] = {"shrink": [], "grow": [], "rebuild": [], "paths": []}
    epoch, life, reform = 1, 0, 0
    full = MembershipView(epoch, tuple(record(m, life if m == last else 0) for m in range(world_size)))
    manager.reconfigure(None, full)
    manager.current.transport.vote(True)  # type: ignore[union-attr]
    try:
        for cycle in range(repeat):
            # 1. shrink: the last rank leaves.
            epoch += 1
            less = MembershipView(epoch, full.members[:-1])
            _barrier(store, f"c{cycle}/shrink", rank, world_size)
            if rank == last:
                manager.close()
            else:
                t0 = time.perf_counter()
                result = manager.reconfigure(full, less, peer_died=True)
                result.transport.vote(True)
                out["shrink"].append(time.perf_counter() - t0)
                out["paths"].append(("shrink", result.path))
            # 2. grow: it comes back as a new incarnation.
            epoch += 1
            life += 1
            full = MembershipView(epoch, less.members + (record(last, life),))
            _barrier(store, f"c{cycle}/grow", rank, world_size)
            t0 = time.perf_counter()
            result = manager.reconfigure(less if rank != last else None, full)
            result.transport.vote(True)
            out["grow"].append(time.perf_counter() - t0)
            out["paths"].append(("grow", result.path))
            # 3. rebuild: rank 0 asks for a new communicator with the same members.
            epoch += 1
            reform += 1
            again = MembershipView(epoch, (record(0, 0, reform),) + full.members[1:])
            _barrier(store, f"c{cycle}/rebuild", rank, world_size)
            t0 = time.perf_counter()
            result = manager.reconfigure(full, again)
            result.transport.vote(True)
            out["rebuild"].append(time.perf_counter() - t0)
            out["paths"].append(("rebuild", result.path))
            full = again
    finally:
        manager.close()
        client.close()
    return out


def _summarize(results, world_size: int, backend: str) -> dict[str, Any]:
    row: dict[str, Any] = {"ranks": world_size, "backend": backend}
    for phase in ("shrink", "grow", "rebuild"):
        per_cycle = np.max(np.array([r.value[phase] for r in results if r.value[phase]]), axis=0)
        row[f"{phase}_p50_s"] = float(np.percentile(per_cycle, 50))
        row[f"{phase}_max_s"] = float(per_cycle.max())
        row[f"{phase}_path"] = sorted({p for r in results for ph, p in r.value["paths"] if ph == phase})
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--backend", nargs="+", default=["nccl4py"], choices=["nccl", "nccl4py", "gloo"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if any(n < 2 for n in args.ranks) or args.repeat < 1:
        parser.error(f"--ranks must be >= 2 and --repeat >= 1, got {args.ranks} and {args.repeat}")

    from elastic_refit.testing.etcd import EtcdServer
    from elastic_refit.testing.processes import nccl_rank_env, run_local_world

    rows = []
    server = EtcdServer(name="nccl-lifecycle")
    server.start()
    try:
        for backend in args.backend:
            for n in args.ranks:
                print(f"{backend}: {n} ranks, {args.repeat} cycles of shrink / grow / rebuild ...", file=sys.stderr)
                job = f"lifecycle-{backend}-{n}-{os.getpid()}"
                results = run_local_world(lifecycle_rank, n, (server.endpoint, job, backend, args.repeat),
                                          timeout_s=540, rank_env=nccl_rank_env)
                failed = [r for r in results if not r.ok]
                if failed:
                    for r in failed:
                        print(f"rank {r.rank}: {r.error_type}: {r.error[:2000]}", file=sys.stderr)
                    rows.append({"ranks": n, "backend": backend, "error": failed[0].error.splitlines()[0]})
                    continue
                rows.append(_summarize(results, n, backend))
    finally:
        server.stop()
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'backend':8} {'ranks':>5}  {'phase':8} {'path':22} {'p50 s':>8} {'max s':>8}")
        for row in rows:
            if "error" in row:
                print(f"{row['backend']:8} {row['ranks']:>5}  error: {row['error']}")
                continue
            for phase in ("shrink", "grow", "rebuild"):
                print(f"{row['backend']:8} {row['ranks']:>5}  {phase:8} {','.join(row[phase + '_path']):22} "
                      f"{row[phase + '_p50_s']:8.3f} {row[phase + '_max_s']:8.3f}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
