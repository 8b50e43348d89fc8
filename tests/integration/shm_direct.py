"""A CPU double of the IPC transport's direct reads, for multi-process executor tests.

:class:`ShmDirect` wraps a real transport (gloo) and offers what
:class:`~elastic_refit.transport.ipc.IpcTransport` offers the executor (``direct_peers``,
``share``, ``peer_buffers``, ``fence_reads``, ``moved``), with the buffers in files under
``/dev/shm`` where the IPC transport has GPU allocations: a reader maps a peer's file instead
of its CUDA IPC handle. Everything else (the executor's order, its signals, the copies) is the
code under test; the mapping itself is the GPU tests' part.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from elastic_refit.layout import Buffer
from elastic_refit.plan import PlanOptions, make_plan
from elastic_refit.testing.faults import FaultyTransport
from elastic_refit.testing.pattern import allocate, check_pieces, fill_pieces
from elastic_refit.testing.world import SENTINEL
from elastic_refit.transport.buffers import byte_view
from elastic_refit.transport.executor import Executor, ExecutorOptions
from elastic_refit.transport.factory import create_transport
from elastic_refit.transport.protocol import Transport
from elastic_refit.transport.schedule import BufferRef


class ShmDirect:
    """``base`` plus direct reads of ``direct_peers``' file-backed buffers (see the module);
    ``files`` names the file of each of this rank's buffers (by ``data_ptr``)."""

    def __init__(self, base: Transport, store: Any, direct_peers: frozenset[int], files: Mapping[int, str]) -> None:
        self.base, self.store, self.direct_peers, self.files = base, store, direct_peers, files
        self.moved = {"direct": 0, "base": 0}
        self.fenced = 0

    rank = property(lambda self: self.base.rank)
    world_size = property(lambda self: self.base.world_size)
    capabilities = property(lambda self: self.base.capabilities)
    device = property(lambda self: self.base.device)
    aborted = property(lambda self: self.base.aborted)

    def post(self, ops):
        return self.base.post(ops)

    def wait(self, work, peer, what):
        self.base.wait(work, peer, what)

    def vote(self, ok, participants=None):
        return self.base.vote(ok, participants)

    def abort(self):
        self.base.abort()

    def close(self):
        self.base.close()

    def share(self, buffers: Mapping[BufferRef, torch.Tensor]) -> int:
        self.store.set(f"shm/{self.rank}/1", json.dumps([[side, name, self.files[t.data_ptr()]]
                                                          for (side, name), t in sorted(buffers.items())]))
        return 1

    def peer_buffers(self, peer: int, gen: int, specs: Mapping[BufferRef, Buffer]) -> dict[BufferRef, torch.Tensor]:
        paths = {(int(side), name): path for side, name, path in json.loads(self.store.get(f"shm/{peer}/{gen}"))}
        out = {}
        for ref, spec in specs.items():
            dtype = getattr(torch, spec.dtype)
            nbytes = int(torch.Size(spec.shape).numel()) * torch.empty((), dtype=dtype).element_size()
            raw = torch.from_file(paths[ref], shared=True, size=nbytes, dtype=torch.uint8)
            out[ref] = raw.view(dtype).view(spec.shape)
        return out

    def fence_reads(self) -> None:
        self.fenced += 1


def _in_shm(tensors: dict[str, torch.Tensor], prefix: str, files: dict[int, str]) -> dict[str, torch.Tensor]:
    """``tensors`` copied into files ``{prefix}-{name}`` (shared mappings), registered in ``files``."""
    out = {}
    for name, t in tensors.items():
        path = f"{prefix}-{name}"
        raw = torch.from_file(path, shared=True, size=t.numel() * t.element_size(), dtype=torch.uint8)
        out[name] = shm = raw.view(t.dtype).view(t.shape)
        shm.copy_(t)
        files[shm.data_ptr()] = path
    return out


def shm_direct_rank(rank: int, world_size: int, store: dist.Store, spec_json: str, domains: tuple[int, ...],
                    directory: str, refits: int, faulty: bool) -> dict[str, Any]:
    """Refit ``spec_json`` planned over ``domains`` (every rank on one host) ``refits`` times,
    same-host messages as direct reads (``faulty``: through a ``FaultyTransport``, as the
    chaos members run); returns the last report and the pattern check of every refit."""
    from elastic_refit.layout import parse_spec
    from elastic_refit.layout.core import Topology

    spec = parse_spec(json.loads(spec_json))
    plan = make_plan(spec.source, spec.destination, Topology(domains, ("host",) * len(domains)),
                     PlanOptions(bucket_bytes=4096, relay="off"))
    base = create_transport("gloo", dist.PrefixStore("gloo", store), rank, world_size, timeout_s=30.0)
    files: dict[int, str] = {}
    src = _in_shm(allocate(plan.source, rank, fill=0), os.path.join(directory, f"r{rank}-src"), files)
    dst = _in_shm(allocate(plan.destination, rank, fill=SENTINEL), os.path.join(directory, f"r{rank}-dst"), files)
    direct = ShmDirect(base, dist.PrefixStore("shm", store), frozenset(set(range(world_size)) - {rank}), files)
    transport: Transport = FaultyTransport(direct) if faulty else direct
    executor = Executor(plan, transport, ExecutorOptions(staging_bytes=1 << 20))
    problems, report = [], None
    for seed in range(1, refits + 1):
        fill_pieces(plan.source, rank, src, seed)
        for t in dst.values():
            byte_view(t).fill_(SENTINEL)
        base.vote(True)  # every rank's buffers are reset before anyone reads them
        report = executor.run(src, dst)
        problems += [f"refit {seed}: {p}" for p in check_pieces(plan.destination, rank, dst, seed)[:3]]
    transport.close()
    return {"rank": rank, "problems": problems, "direct_recv_bytes": report.direct_recv_bytes,
            "fenced": direct.fenced}
