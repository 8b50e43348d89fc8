"""Every gloo group of a process shares the process's one device (``transport.factory.gloo_device``):
groups dropped after a send timed out leave the device usable for the next group between the
same ranks, and the process holds one gloo listener, whatever became of its groups."""

from __future__ import annotations

import datetime

import torch
from elastic_refit.chaos.worker import open_tcp_sockets

from elastic_refit.testing.processes import run_local_world

ROUNDS = 3


def _listening() -> set[str]:
    return {s for s in open_tcp_sockets() if s.endswith("st=0A")}


def _rank(rank: int, world_size: int, store) -> dict:
    import torch.distributed as dist

    from elastic_refit.transport.factory import gloo_group

    before = _listening()
    t = torch.ones(1 << 16)
    failed = 0
    for i in range(ROUNDS):
        pg = gloo_group(dist.PrefixStore(f"stuck{i}", store), rank, world_size, timeout_s=0.5)
        if rank == 0:  # rank 1 never receives: the send times out, and the group is dropped
            work = pg.send([t], 1, 0)
            try:
                work.wait(datetime.timedelta(seconds=0.5))
            except RuntimeError:
                failed += 1
            del work
        del pg
        store.set(f"dropped{rank}/{i}", "1")
        store.wait([f"dropped{1 - rank}/{i}"])
        pg = gloo_group(dist.PrefixStore(f"ok{i}", store), rank, world_size, timeout_s=10.0)
        buf = torch.full((4,), float(i)) if rank == 0 else torch.zeros(4)
        (pg.send if rank == 0 else pg.recv)([buf], 1 - rank, 1).wait()
        assert buf.tolist() == [float(i)] * 4
        del pg
    store.set(f"end{rank}", "1")
    store.wait([f"end{1 - rank}"])
    return {"failed": failed, "new_listening": sorted(_listening() - before)}


def test_the_shared_device_serves_new_groups_after_groups_died_with_a_timed_out_send():
    results = run_local_world(_rank, 2, timeout_s=120.0)
    assert all(r.ok for r in results), [(r.rank, r.error[:400]) for r in results if not r.ok]
    sender, receiver = (r.value for r in results)
    assert sender["failed"] == ROUNDS  # every stuck send did time out
    # The shared device's listener (made by the first group) and nothing else, on both sides.
    assert len(sender["new_listening"]) <= 1 and len(receiver["new_listening"]) <= 1, (sender, receiver)
