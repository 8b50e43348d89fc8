"""Lease keepalive answer times of one process, its client loop idle or busy.

    python benchmarks/bench_lease_keeper.py --leases 512 --switch-interval-ms 5 [--busy-s 8]

One process keeps ``--leases`` leases of a 2 s TTL through its client's LeaseKeeper
(membership/leases.py) while the client loop runs CPU-bound callbacks of 10 ms back to
back for ``--busy-s`` seconds (as a process hosting hundreds of members does on every
change); it prints the keepalive answer times (sent -> answer read) and how many leases
expired. The keeper has a thread and a channel of its own, but shares the GIL: with
CPython's default 5 ms switch interval its answers wait behind the busy loop.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from elastic_refit.membership.client import EtcdClient
from elastic_refit.membership.leases import lease_keeper

from elastic_refit.testing.etcd import EtcdServer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", type=int, default=512)
    parser.add_argument("--switch-interval-ms", type=float, default=5.0)
    parser.add_argument("--busy-s", type=float, default=8.0, help="0: an idle client loop")
    args = parser.parse_args()
    if args.leases < 1 or args.switch_interval_ms <= 0 or args.busy_s < 0:
        raise SystemExit(f"need --leases >= 1, --switch-interval-ms > 0, --busy-s >= 0, got {vars(args)}")
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    with EtcdServer(name="lease-bench") as etcd:
        client = EtcdClient(etcd.endpoints)
        keeper = lease_keeper(client)
        leases = []
        for _ in range(args.leases):  # each kept from its grant on (granting all takes longer than the TTL)
            asked = time.monotonic()
            leases.append(client.grant_lease(2)[0])
            keeper.keep(leases[-1], ttl_s=2, interval_s=2 / 3, on_lost=lambda _reason: None, renewed_at=asked)
        time.sleep(2.0)
        keeper.latencies.clear()

        async def busy() -> None:
            end = time.monotonic() + max(args.busy_s, 0.0)
            while time.monotonic() < end:
                t = time.monotonic()
                while time.monotonic() - t < 0.01:
                    pass
                await asyncio.sleep(0)

        if args.busy_s:
            client.run(busy(), timeout_s=args.busy_s + 30)
        else:
            time.sleep(8.0)
        lat = sorted(keeper.latencies)
        expired = sum(1 for lease in leases if client.lease_ttl(lease) <= 0)
        print(f"{args.leases} leases, GIL switch interval {args.switch_interval_ms} ms, client loop "
              f"{'busy' if args.busy_s else 'idle'}: {len(lat)} answers, p50 {lat[len(lat) // 2] * 1e3:.0f} ms, "
              f"p99 {lat[int(len(lat) * 0.99)] * 1e3:.0f} ms, max {lat[-1] * 1e3:.0f} ms; {expired} expired")
        client.close()


if __name__ == "__main__":
    main()
