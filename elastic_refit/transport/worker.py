"""One rank of a local refit world: plan, agree, build the group, move, verify.

Shared by the multi-process tests and ``elastic-refit bench``. Source pieces are filled
with the deterministic pattern, destination buffers with a sentinel, and after the refit
every destination piece is compared with the pattern and every byte outside pieces with
the sentinel.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from elastic_refit.errors import PlanMismatch
from elastic_refit.layout import Layout, RefitSpec, parse_spec
from elastic_refit.plan import Plan, PlanOptions, make_plan
from elastic_refit.transport.executor import Executor, ExecutorOptions
from elastic_refit.transport.group import GroupOptions, RefitGroup
from elastic_refit.transport.pattern import allocate, byte_view, check_pieces, fill_pieces

SENTINEL = 0x5A


@dataclass(frozen=True, slots=True)
class RefitCase:
    """A refit to run on a local world: a spec (JSON text) or a model preset."""

    spec_json: str | None = None
    model: str | None = None
    source: str | None = None
    destination: str | None = None
    num_layers: int | None = None
    domain_size: int = 8
    colocate: bool = False
    bucket_bytes: int = 64 << 20

    def build(self) -> RefitSpec:
        if self.spec_json is not None:
            return parse_spec(json.loads(self.spec_json))
        from elastic_refit.layout.refit import model_refit_spec

        if not (self.model and self.source and self.destination):
            raise ValueError("a model case needs model, source and destination")
        return model_refit_spec(self.model, self.source, self.destination, domain_size=self.domain_size,
                                num_layers=self.num_layers, colocate=self.colocate)

    def plan(self) -> Plan:
        spec = self.build()
        return make_plan(spec.source, spec.destination, spec.topology, PlanOptions(bucket_bytes=self.bucket_bytes))


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    backend: str = "gloo"
    timeout_s: float = 30.0
    staging_bytes: int = 256 << 20
    verify: bool = False
    pack_backend: str = "auto"
    repeat: int = 1
    warmup: int = 0
    seed: int = 1234
    extra: dict[str, Any] = field(default_factory=dict)


def agree_on_plan(store: dist.Store, rank: int, world_size: int, fingerprint: str, key: str = "plan") -> None:
    """Every rank publishes its plan fingerprint and checks all others before data moves."""
    store.set(f"{key}/{rank}", fingerprint)
    store.wait([f"{key}/{r}" for r in range(world_size)])
    for r in range(world_size):
        other = store.get(f"{key}/{r}").decode()
        if other != fingerprint:
            raise PlanMismatch(f"rank {rank} planned {fingerprint} but rank {r} planned {other}")


def padding_problems(layout: Layout, rank: int, buffers: dict[str, torch.Tensor], sentinel: int) -> list[str]:
    """Bytes outside every piece must still hold the sentinel."""
    problems = []
    for name, tensor in buffers.items():
        view = byte_view(tensor)
        mask = torch.ones(view.shape, dtype=torch.bool, device=view.device)
        for p in np.flatnonzero(layout.piece_rank == rank).tolist():
            b = int(layout.piece_buffer[p])
            if layout.buffer_names[int(layout.buffer_name[b])] != name:
                continue
            nd = int(layout.buffer_ndim[b])
            itemsize = tensor.element_size()
            off, ln = layout.piece_local_offsets[p, :nd], layout.piece_local_lengths[p, :nd]
            sl = [slice(int(o), int(o + n)) for o, n in zip(off[:-1], ln[:-1], strict=True)]
            sl.append(slice(int(off[-1]) * itemsize, int(off[-1] + ln[-1]) * itemsize))
            mask[tuple(sl)] = False
        changed = int((view[mask] != sentinel).sum())
        if changed:
            problems.append(f"rank {rank} buffer {name!r}: {changed} padding bytes changed")
    return problems


def refit_rank(rank: int, world_size: int, store: dist.Store, case: RefitCase, options: WorkerOptions,
               before_run: Callable[[RefitGroup, Executor], None] | None = None) -> dict[str, Any]:
    """Run ``case`` on this rank and return its report, timings and verification result."""
    t0 = time.perf_counter()
    plan = case.plan()
    plan_seconds = time.perf_counter() - t0
    agree_on_plan(store, rank, world_size, plan.fingerprint)
    device = "cpu"
    if options.backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    group = RefitGroup.create(dist.PrefixStore("refit", store), rank, world_size,
                              GroupOptions(options.backend, options.timeout_s))
    executor = Executor(plan, group, ExecutorOptions(staging_bytes=options.staging_bytes, verify=options.verify,
                                                     pack_backend=options.pack_backend))
    src = allocate(plan.source, rank, fill=0, device=device)
    dst = allocate(plan.destination, rank, fill=SENTINEL, device=device)
    fill_pieces(plan.source, rank, src, options.seed)
    if before_run is not None:
        before_run(group, executor)
    reports = []
    for _ in range(options.warmup):
        executor.run(src, dst)
    for _ in range(options.repeat):
        reports.append(executor.run(src, dst))
    problems = check_pieces(plan.destination, rank, dst, options.seed)
    problems += padding_problems(plan.destination, rank, dst, SENTINEL)
    group.abort()  # done with this world; nothing else uses the group
    return {
        "rank": rank,
        "plan_seconds": plan_seconds,
        "fingerprint": plan.fingerprint,
        "seconds": [r.seconds for r in reports],
        "report": asdict(reports[-1]),
        "problems": problems,
        "staging_limit": options.staging_bytes,
    }
