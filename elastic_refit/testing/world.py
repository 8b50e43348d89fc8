"""One rank of a local refit world: plan, agree, build the transport, move, verify.

Shared by the multi-process tests and ``elastic-refit bench``. Source pieces are filled
with the deterministic pattern, destination buffers with a sentinel, and after the refit
every destination piece is compared with the pattern and every byte outside pieces with
the sentinel.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from elastic_refit.layout import Layout, RefitSpec, parse_spec
from elastic_refit.layout.models import ModelConfig
from elastic_refit.membership.attempts import agree_on_plan
from elastic_refit.plan import Plan, PlanOptions, make_plan
from elastic_refit.testing.faults import FaultyTransport
from elastic_refit.testing.pattern import allocate, check_pieces, fill_pieces
from elastic_refit.transport.buffers import byte_view, split_box
from elastic_refit.transport.executor import Executor, ExecutorOptions
from elastic_refit.transport.factory import create_transport
from elastic_refit.transport.protocol import Backend, Transport, post_recv, post_send

SENTINEL = 0x5A


@dataclass(frozen=True, slots=True)
class RefitCase:
    """A refit to run on a local world: a spec (JSON text) or a model preset."""

    spec_json: str | None = None
    model: str | ModelConfig | None = None
    source: str | None = None
    destination: str | None = None
    num_layers: int | None = None
    domain_size: int = 8
    colocate: bool = False
    bucket_bytes: int = 64 << 20
    direct_min_bytes: int = 256 << 10
    concurrent_rounds: int = 1
    relay: str = "auto"  # PlanOptions.relay
    # Destination formats (``TensorFormats.to_json``): the bench also runs the refit into
    # this quantized destination (``plan_quantized``), beside the BF16 one.
    formats_json: str | None = None

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
        return make_plan(spec.source, spec.destination, spec.topology,
                         PlanOptions(bucket_bytes=self.bucket_bytes, direct_min_bytes=self.direct_min_bytes,
                                     concurrent_rounds=self.concurrent_rounds, relay=self.relay))

    def plan_quantized(self) -> Plan | None:
        """The same refit into the destination formats ``formats_json`` names (None without)."""
        if not self.formats_json:
            return None
        from elastic_refit.layout import TensorFormats

        spec = self.build()
        return make_plan(spec.source, spec.destination, spec.topology,
                         PlanOptions(bucket_bytes=self.bucket_bytes, direct_min_bytes=self.direct_min_bytes,
                                     concurrent_rounds=self.concurrent_rounds),
                         formats=TensorFormats.from_json(self.formats_json))


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """Options of ``refit_rank``: the transport, the executor and how often to run."""

    backend: str = "gloo"
    timeout_s: float = 30.0
    staging_bytes: int = 256 << 20
    verify: bool = False
    pack_backend: str = "auto"
    repeat: int = 1
    warmup: int = 0
    seed: int = 1234

    def __post_init__(self) -> None:
        Backend.parse(self.backend)
        if self.repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {self.repeat}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")


def make_transport(store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float) -> Transport:
    """This rank's transport of a local world: gloo on the CPU, or NCCL (torch's process
    group or an nccl4py communicator) on the GPU ``nccl_rank_env`` gave this rank."""
    kind = Backend.parse(backend)
    if kind is not Backend.GLOO:
        torch.cuda.set_device(int(os.environ.get("ELASTIC_REFIT_CUDA_DEVICE", rank % max(1, torch.cuda.device_count()))))
    return create_transport(kind, store, rank, world_size, timeout_s=timeout_s)


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


def leave_together(store: dist.Store, rank: int, world_size: int, timeout_s: float, *, key: str = "left",
                   outcome: str = "done") -> list[int]:
    """Say that this rank is done with the world (``outcome``) and, after a clean run, wait
    (up to ``timeout_s``) until every rank has said so; returns the ranks that had not.

    Why: a collective that returned on this rank may still be in flight to its peers. NCCL
    completes a rank's kernel once its sends are handed to its proxy thread, and over the
    socket transport (ranks sharing a GPU, each its own ``NCCL_HOSTID``) the proxy writes
    them later: a rank that aborted its communicator or exited right after the closing vote
    took the vote's last message with it, and its peers' votes failed ("NCCL error 6: remote
    process exited") or timed out. Seen on the H200 with 4-8 ranks per world and eight test
    workers side by side, whose proxies ran late; never with one world at a time. A failed
    rank only says so (its peers' refits failed too, nobody waits for it)."""
    store.set(f"{key}/{rank}", outcome)
    if outcome != "done":
        return []
    keys = [f"{key}/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
        return []
    except Exception:  # the store's timeout: name who did not come
        return [r for r, k in enumerate(keys) if not store.check([k])]


def left_before(store: dist.Store, world_size: int, *, key: str = "left") -> dict[int, str]:
    """The ranks that had left the world (their ``leave_together`` outcome), by rank."""
    out = {}
    for r in range(world_size):
        k = f"{key}/{r}"
        if store.check([k]):
            raw = store.get(k)
            out[r] = raw.decode() if isinstance(raw, bytes) else str(raw)
    return out


def refit_rank(rank: int, world_size: int, store: dist.Store, case: RefitCase, options: WorkerOptions,
               fault: Callable[[FaultyTransport], None] | None = None) -> dict[str, Any]:
    """Run ``case`` on this rank and return its report, timings and verification result.
    ``fault`` programs this rank's transport, wrapped in a ``FaultyTransport``."""
    t0 = time.perf_counter()
    plan = case.plan()
    plan_seconds = time.perf_counter() - t0
    agree_on_plan(store, plan.fingerprint, me=str(rank), participants=[str(r) for r in range(world_size)],
                  key=lambda r: f"plan/{r}")
    transport: Transport = make_transport(dist.PrefixStore("refit", store), rank, world_size,
                                          options.backend, options.timeout_s)
    device = transport.device
    if fault is not None:
        transport = FaultyTransport(transport)
        fault(transport)
    executor = Executor(plan, transport, ExecutorOptions(staging_bytes=options.staging_bytes, verify=options.verify,
                                                     pack_backend=options.pack_backend))
    src = allocate(plan.source, rank, fill=0, device=device)
    dst = allocate(plan.destination, rank, fill=SENTINEL, device=device)
    fill_pieces(plan.source, rank, src, options.seed)
    reports = []
    try:
        for _ in range(options.warmup):
            executor.run(src, dst)
        for _ in range(options.repeat):
            reports.append(executor.run(src, dst))
    except BaseException as exc:
        # Who had left by then names the first rank to fail (the others failed after it).
        left = left_before(store, world_size)
        leave_together(store, rank, world_size, options.timeout_s, outcome=f"failed: {type(exc).__name__}")
        exc.add_note(f"rank {rank}: ranks that had left the world by then: {left or 'none'}")
        raise
    problems = check_pieces(plan.destination, rank, dst, options.seed)
    problems += padding_problems(plan.destination, rank, dst, SENTINEL)
    late = leave_together(store, rank, world_size, options.timeout_s)
    if late:
        problems.append(f"rank {rank}: ranks {late} did not finish the world within {options.timeout_s} s")
    transport.abort()  # every rank is done with this world: nothing of it is in flight
    return {
        "rank": rank,
        "plan_seconds": plan_seconds,
        "fingerprint": plan.fingerprint,
        "seconds": [r.seconds for r in reports],
        "report": asdict(reports[-1]),
        "problems": problems,
        "staging_limit": options.staging_bytes,
    }


# ---- side-by-side benchmark: reshard vs gather-and-broadcast ----------------------------

@dataclass(frozen=True, slots=True)
class BenchOptions(WorkerOptions):
    """Options of ``bench_rank``. ``verify`` turns on the executor's wire digests; every
    destination byte is checked against the pattern after every run regardless.
    ``p2p_bytes`` is the message size of the raw send/recv measurement."""

    timeout_s: float = 120.0
    repeat: int = 3
    warmup: int = 1
    chunk_bytes: int = 8 << 20
    p2p_bytes: int = 128 << 20
    p2p_repeat: int = 3
    # Also time the reshard as the runtime runs it with verification on (a third method,
    # ``reshard_checked``, beside the plain reshard in the same run): buffer and replica
    # region digests of the sources first (publish), and their check after the sends.
    snapshot_digests: bool = False
    # torch intra-op threads of each rank (0: torch's default, one per core). Many ranks on
    # few cores spin against each other with more than one each (launchers such as torchrun
    # set OMP_NUM_THREADS=1 for that reason).
    torch_threads: int = 0

    def __post_init__(self) -> None:
        WorkerOptions.__post_init__(self)
        if self.p2p_bytes < 1 or self.p2p_repeat < 1:
            raise ValueError(f"p2p_bytes and p2p_repeat must be >= 1, got {self.p2p_bytes}, {self.p2p_repeat}")
        if self.torch_threads < 0:
            raise ValueError(f"torch_threads must be >= 0, got {self.torch_threads}")


_CHECK_ELEMENTS = 1 << 22  # pattern check slice: bounds the int64 temporaries to ~100 MB


def finite_pattern(name: str, shape: tuple[int, ...], offsets, lengths, seed: int, device) -> torch.Tensor:
    """The pattern of a BF16 box made finite (exponent's top bit cleared: |x| < 2), as
    ``torch.bfloat16`` of the box's shape: what the bench's quantized tensors hold."""
    from elastic_refit.testing.pattern import pattern_bytes

    raw = pattern_bytes(name, shape, 2, tuple(offsets), tuple(lengths), seed, device).view(torch.int16)
    return (raw & 0x3FFF | (raw & -0x8000)).view(torch.bfloat16).reshape(tuple(lengths))


def pattern_pieces(layout: Layout, rank: int, buffers: dict[str, torch.Tensor], seed: int, *,
                   write: bool, limit: int = 5, finite: frozenset[str] = frozenset(),
                   skip: frozenset[str] = frozenset()) -> list[str]:
    """Fill (``write``) or check every piece of ``rank`` against the pattern, in slices of
    ``_CHECK_ELEMENTS`` so that multi-GB pieces need no multi-GB temporaries. Checking
    returns up to ``limit`` mismatch descriptions. Tensors named in ``finite`` (BF16) hold
    ``finite_pattern`` (what a quantizer accepts); tensors named in ``skip`` are left out."""
    from elastic_refit.testing.pattern import _local_view, pattern_bytes

    problems: list[str] = []
    k = layout.ndim
    for p in np.flatnonzero(layout.piece_rank == rank).tolist():
        t = layout.tensors[int(layout.piece_tensor[p])]
        if t.name in skip:
            continue
        b = int(layout.piece_buffer[p])
        nd, bnd = len(t.shape), int(layout.buffer_ndim[b])
        buf = buffers[layout.buffer_names[int(layout.buffer_name[b])]]
        off = [int(v) for v in layout.piece_offsets[p, :nd]]
        ln = [int(v) for v in layout.piece_lengths[p, :nd]]
        wrong = 0
        for so, sn in split_box(off, ln, _CHECK_ELEMENTS):
            lo, ll = layout.local_regions(np.array([p]), np.array([so + [0] * (k - nd)]),
                                          np.array([sn + [1] * (k - nd)]))
            region = _local_view(buf, lo[0, :bnd], ll[0, :bnd], t.itemsize)
            if t.name in finite:
                want = finite_pattern(t.name, t.shape, so, sn, seed, buf.device).reshape(-1).view(torch.uint8)
            else:
                want = pattern_bytes(t.name, t.shape, t.itemsize, tuple(so), tuple(sn), seed, buf.device)
            if write:
                region.copy_(want.reshape(region.shape))
            else:
                wrong += int((region != want.reshape(region.shape)).sum())
        if wrong:
            problems.append(f"rank {rank} tensor {t.name!r} piece {layout.piece(p).box}: {wrong} bytes differ")
            if len(problems) >= limit:
                break
    return problems


def quantized_problems(plan: Plan, rank: int, buffers: dict[str, torch.Tensor], seed: int,
                       limit: int = 5) -> list[str]:
    """Check every destination piece of ``rank`` of a quantized ``plan`` against the
    reference quantizer (``kernels.quantize.quantize_reference``) of the blocks it touches:
    FP8 bytes and scales (the sources of quantized tensors hold ``finite_pattern``); plain
    tensors against the pattern. The blocks a piece touches, taken whole, quantize as they
    do inside the whole tensor, so no rank needs a whole tensor; they are checked in slices
    of whole blocks (``_CHECK_ELEMENTS``), so multi-GB expert pieces need no multi-GB
    temporaries."""
    from elastic_refit.kernels.quantize import quantize_reference
    from elastic_refit.testing.pattern import _local_view

    q = plan.quantization
    dst = plan.destination
    element_of = {scale: name for name, scale in q.scale_tensor.items()}
    quantized = frozenset(q.scale_tensor) | frozenset(element_of)
    problems = pattern_pieces(dst, rank, buffers, seed, write=False, limit=limit, skip=quantized)
    k = dst.ndim
    for p in np.flatnonzero(dst.piece_rank == rank).tolist():
        t = dst.tensors[int(dst.piece_tensor[p])]
        if t.name not in quantized:
            continue
        is_scale = t.name in element_of
        name = element_of.get(t.name, t.name)
        fmt = q.format_of(name)
        logical = q.logical_destination.tensor(name)
        nd = len(logical.shape)
        off = [int(v) for v in dst.piece_offsets[p, :nd]]
        ln = [int(v) for v in dst.piece_lengths[p, :nd]]
        # a scale piece's box is in blocks already
        p_boff, p_blen = (off, ln) if is_scale else fmt.block_box(off, ln)
        block_elements = fmt.block_shape[0] * fmt.block_shape[1]
        b = int(dst.piece_buffer[p])
        buf = buffers[dst.buffer_names[int(dst.buffer_name[b])]]
        bnd = int(dst.buffer_ndim[b])
        wrong = 0
        for b_off, b_len in split_box(list(p_boff), list(p_blen), max(1, _CHECK_ELEMENTS // block_elements)):
            # the elements of these blocks, clipped to the tensor
            e_off = [*b_off[:-2], *(o * s for o, s in zip(b_off[-2:], fmt.block_shape, strict=True))]
            e_end = [*(o + n for o, n in zip(b_off[:-2], b_len[:-2], strict=True)),
                     *(min((o + n) * s, d) for o, n, s, d in zip(b_off[-2:], b_len[-2:], fmt.block_shape,
                                                                logical.shape[-2:], strict=True))]
            e_len = [e - o for o, e in zip(e_off, e_end, strict=True)]
            fp8, scales = quantize_reference(finite_pattern(name, logical.shape, e_off, e_len, seed, "cpu"),
                                             fmt, name=name)
            if is_scale:
                sub_off, sub_len, want = b_off, b_len, scales
            else:  # the piece's elements among these blocks
                sub_off = [max(a, o) for a, o in zip(e_off, off, strict=True)]
                sub_len = [min(a + n, o + m) - s for a, n, o, m, s in zip(e_off, e_len, off, ln, sub_off, strict=True)]
                want = fp8[tuple(slice(s - a, s - a + n) for s, a, n in zip(sub_off, e_off, sub_len, strict=True))]
            lo, ll = dst.local_regions(np.array([p]), np.array([list(sub_off) + [0] * (k - nd)]),
                                       np.array([list(sub_len) + [1] * (k - nd)]))
            region = _local_view(buf, lo[0, :bnd], ll[0, :bnd], t.itemsize)
            want = want.contiguous().view(torch.uint8).reshape(-1)
            wrong += int((region.cpu().reshape(-1) != want).sum())
        if wrong:
            problems.append(f"rank {rank} tensor {t.name!r} piece {dst.piece(p).box}: "
                            f"{wrong} bytes differ from the reference quantizer")
            if len(problems) >= limit:
                break
    return problems


def _padded_buffers(layout: Layout, rank: int, buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Buffers whose pieces do not fill them (the only ones with padding to check)."""
    covered: dict[str, int] = {}
    nbytes = layout.piece_nbytes()
    for p in np.flatnonzero(layout.piece_rank == rank).tolist():
        b = int(layout.piece_buffer[p])
        name = layout.buffer_names[int(layout.buffer_name[b])]
        covered[name] = covered.get(name, 0) + int(nbytes[p])
    return {n: t for n, t in buffers.items() if covered.get(n, 0) != t.numel() * t.element_size()}


def _buffer_digests(buffers: dict[str, torch.Tensor]) -> dict[str, str]:
    """SHA-1 of every buffer's bytes."""
    import hashlib

    return {n: hashlib.sha1(byte_view(t).reshape(-1).cpu().numpy()).hexdigest() for n, t in buffers.items()}


def _p2p(transport: Transport, pairs: list[tuple[int, int]], nbytes: int, repeat: int) -> list[float]:
    """Seconds of ``repeat`` one-message transfers over ``pairs`` at once (after one
    warm-up, which also sets up the lazily connected pairs); this rank's times."""
    rank = transport.rank
    role = next(((peer, True) for a, peer in pairs if a == rank), None) or \
        next(((a, False) for a, b in pairs if b == rank), None)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=transport.device) if role else None
    if buf is not None:
        buf.fill_(rank)
    out = []
    for i in range(repeat + 1):
        transport.vote(True)  # barrier: every pair starts together
        t0 = time.perf_counter()
        if role is not None:
            peer, sender = role
            work = post_send(transport, buf, peer, 1 << 30) if sender else post_recv(transport, buf, peer, 1 << 30)
            transport.wait(work, peer, "p2p bandwidth")
            if transport.device.type == "cuda":
                torch.cuda.synchronize(transport.device)
        if i:
            out.append(time.perf_counter() - t0)
    return out


def _with_snapshot_digests(run: Callable, source: Layout, rank: int) -> Callable:
    """``run`` with the runtime's source checks around it, timed as part of it: digests of
    every source buffer and replica region before (``publish``), and of every buffer again
    once its sends are done, before the closing vote (a changed source is refused)."""
    from elastic_refit.runtime.replicas import region_digests, replica_regions
    from elastic_refit.transport.buffers import buffer_digests

    regions = replica_regions(source)
    checks_seconds: list[float] = []  # per run: this rank's time in the digests and checks alone

    def refit(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]):
        t0 = time.perf_counter()
        before = buffer_digests(src)
        region_digests(source, rank, src, regions, known=before)
        spent = time.perf_counter() - t0

        def unchanged() -> None:
            nonlocal spent
            t1 = time.perf_counter()
            if buffer_digests(src) != before:
                raise RuntimeError(f"rank {rank}: a source buffer changed during the refit")
            spent += time.perf_counter() - t1

        report = run(src, dst, before_vote=unchanged)
        checks_seconds.append(spent)
        return dataclasses.replace(report, seconds=time.perf_counter() - t0)

    refit.checks_seconds = checks_seconds  # type: ignore[attr-defined]
    return refit


@dataclass(frozen=True, slots=True)
class _BenchPlans:
    """The bench's plans, agreed by every rank: into the BF16 destination, and into the
    quantized one (``fp8``; None when the case names no destination formats)."""

    plan: Plan
    fp8: Plan | None

    @property
    def finite(self) -> frozenset[str]:
        """Tensors whose sources hold ``finite_pattern`` (what a quantizer accepts)."""
        return frozenset(self.fp8.quantization.scale_tensor) if self.fp8 is not None else frozenset()


@dataclass(frozen=True, slots=True)
class _BenchMethods:
    """The refits the bench times, by name (``run(src, dst)``), the destination buffers each
    fills and the pattern-filled source buffers they all read."""

    runs: dict[str, Callable]
    destinations: dict[str, dict[str, torch.Tensor]]
    source: dict[str, torch.Tensor]


def _agreed_plans(rank: int, world_size: int, store: dist.Store, case: RefitCase) -> _BenchPlans:
    """This rank's plans of ``case``, once every rank agreed on their fingerprints."""
    plan = case.plan()
    fp8_plan = case.plan_quantized()
    agree_on_plan(store, plan.fingerprint + (fp8_plan.fingerprint if fp8_plan is not None else ""), me=str(rank),
                  participants=[str(r) for r in range(world_size)], key=lambda r: f"bench-plan/{r}")
    return _BenchPlans(plan, fp8_plan)


def _p2p_seconds(transport: Transport, world_size: int, options: BenchOptions) -> tuple[list[float], list[float]]:
    """Raw send/recv seconds: ranks 0 -> 1 alone, then every rank of the first half to its
    peer in the second half at once (none in a world of one rank)."""
    if world_size <= 1:
        return [], []
    half = world_size // 2
    pair = _p2p(transport, [(0, 1)], options.p2p_bytes, options.p2p_repeat)
    return pair, _p2p(transport, [(i, i + half) for i in range(half)], options.p2p_bytes, options.p2p_repeat)


def _bench_methods(plans: _BenchPlans, transport: Transport, rank: int, options: BenchOptions,
                   say: Callable[[str], None]) -> _BenchMethods:
    """The executor's reshard and the gather-and-broadcast baseline (plus, as ``options``
    and the case ask, the reshard with the runtime's source checks and the one into the FP8
    destination), with the sources filled with the pattern and destinations allocated."""
    from elastic_refit.transport.baseline import BaselineOptions, GatherBroadcast

    plan, device = plans.plan, transport.device
    executor_options = ExecutorOptions(staging_bytes=options.staging_bytes, verify=options.verify,
                                       pack_backend=options.pack_backend)
    executor = Executor(plan, transport, executor_options)
    baseline = GatherBroadcast(plan, transport, BaselineOptions(chunk_bytes=options.chunk_bytes))
    say("filling source buffers with the pattern")
    src = allocate(plan.source, rank, fill=0, device=device)
    pattern_pieces(plan.source, rank, src, options.seed, write=True, finite=plans.finite)
    dst = allocate(plan.destination, rank, fill=SENTINEL, device=device)
    runs: dict[str, Callable] = {"reshard": executor.run, "gather_broadcast": baseline.run}
    if options.snapshot_digests:
        runs["reshard_checked"] = _with_snapshot_digests(executor.run, plan.source, rank)
    destinations = dict.fromkeys(runs, dst)
    if plans.fp8 is not None:
        # The same sources into an FP8 destination: quantized on the senders, FP8 bytes
        # and scales on the wire, checked against the reference quantizer.
        executor_fp8 = Executor(plans.fp8, transport, executor_options)
        dst_fp8 = allocate(plans.fp8.destination, rank, fill=SENTINEL, device=device)
        runs["reshard_fp8"] = lambda s, _d: executor_fp8.run(s, dst_fp8)
        destinations["reshard_fp8"] = dst_fp8
    return _BenchMethods(runs, destinations, src)


def _first_run_problems(method: str, plans: _BenchPlans, rank: int, out: dict[str, torch.Tensor],
                        seed: int) -> list[str]:
    """A destination's first run checked byte by byte: its pieces against the pattern (the
    FP8 one against the reference quantizer), its padding against the sentinel."""
    if method == "reshard_fp8":
        layout = plans.fp8.destination
        problems = quantized_problems(plans.fp8, rank, out, seed)
    else:
        layout = plans.plan.destination
        problems = pattern_pieces(layout, rank, out, seed, write=False, finite=plans.finite)
    return problems + padding_problems(layout, rank, _padded_buffers(layout, rank, out), SENTINEL)


def _run_problems(method: str, plans: _BenchPlans, rank: int, out: dict[str, torch.Tensor], seed: int,
                  references: dict[int, dict[str, str]]) -> list[str]:
    """What is wrong with ``out`` after a run of ``method``. The first run into a destination
    is checked against the pattern byte by byte and its digests kept in ``references``;
    later runs must reproduce those verified buffers exactly (a SHA-1 per buffer:
    generating the pattern again would cost more than the refit)."""
    reference = references.get(id(out))
    if reference is None:
        problems = _first_run_problems(method, plans, rank, out, seed)
        references[id(out)] = _buffer_digests(out)
        return problems
    return [f"rank {rank} buffer {n!r} differs from the pattern-verified first run"
            for n, d in _buffer_digests(out).items() if d != reference[n]]


def _bench_runs(transport: Transport, methods: _BenchMethods, plans: _BenchPlans, rank: int,
                options: BenchOptions, say: Callable[[str], None]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Every method ``warmup + repeat`` times, alternating which goes first, each run into
    sentinel-filled destinations and checked; returns each method's seconds and problems,
    and each method's last report."""
    results: dict[str, dict[str, Any]] = {m: {"seconds": [], "warmup_seconds": [], "problems": []}
                                          for m in methods.runs}
    last: dict[str, Any] = {}
    references: dict[int, dict[str, str]] = {}  # per destination (the FP8 one has its own)
    for i in range(options.warmup + options.repeat):
        order = list(methods.runs) if i % 2 == 0 else list(methods.runs)[::-1]
        for m in order:
            out = methods.destinations[m]
            for t in out.values():
                byte_view(t).fill_(SENTINEL)
            transport.vote(True)  # start together; the refit's own vote ends it together
            report = methods.runs[m](methods.source, out)
            key = "warmup_seconds" if i < options.warmup else "seconds"
            results[m][key].append(report.seconds)
            last[m] = report
            problems = _run_problems(m, plans, rank, out, options.seed, references)
            if problems and len(results[m]["problems"]) < 5:
                results[m]["problems"] += [f"run {i}: {p}" for p in problems]
            phase = "warm-up" if i < options.warmup else f"repeat {i - options.warmup + 1}/{options.repeat}"
            verdict = f"{len(problems)} problems on rank 0" if problems else "verified"
            say(f"{phase}: {m} {report.seconds:.3f} s (rank 0), {verdict}")
    return results, last


def _byte_counts(last: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Each method's bytes, from its last report (the executor's and the baseline's)."""
    counts = {}
    for m in last.keys() - {"gather_broadcast"}:
        ex = last[m]
        counts[m] = dict(send_bytes=ex.network_send_bytes + ex.intra_send_bytes,
                         recv_bytes=ex.network_recv_bytes + ex.intra_recv_bytes,
                         local_bytes=ex.local_bytes, staging_bytes=ex.staging_bytes)
    gb = last["gather_broadcast"]
    counts["gather_broadcast"] = dict(send_bytes=gb.send_bytes, recv_bytes=gb.recv_bytes, local_bytes=gb.local_bytes,
                                      staging_bytes=gb.staging_bytes, num_messages=gb.num_messages)
    return counts


def bench_rank(rank: int, world_size: int, store: dist.Store, case: RefitCase, options: BenchOptions,
               progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """One rank of ``elastic-refit bench``: raw send/recv bandwidth, then the reshard
    (executor) and gather-and-broadcast (baseline) refits ``repeat`` times each after
    ``warmup``, alternating which goes first to cancel drift. Destination buffers are set
    to the sentinel before every run; the first run is checked byte by byte against the
    pattern (pieces and padding), every later run must reproduce it exactly (SHA-1 per
    buffer). Returns this rank's seconds, bytes and problems."""
    say = progress if (progress is not None and rank == 0) else (lambda _m: None)
    if options.torch_threads:
        torch.set_num_threads(options.torch_threads)
    plans = _agreed_plans(rank, world_size, store, case)
    transport = make_transport(dist.PrefixStore("bench", store), rank, world_size, options.backend,
                               options.timeout_s)
    try:
        say(f"raw send/recv: {options.p2p_bytes >> 20} MiB messages")
        p2p_pair, p2p_all = _p2p_seconds(transport, world_size, options)
        methods = _bench_methods(plans, transport, rank, options, say)
        results, last = _bench_runs(transport, methods, plans, rank, options, say)
        for m, counts in _byte_counts(last).items():
            results[m].update(counts)
        if "reshard_checked" in methods.runs:  # the timed runs only (the warm-ups come first)
            results["reshard_checked"]["checks_seconds"] = \
                methods.runs["reshard_checked"].checks_seconds[options.warmup:]
    except BaseException as exc:
        leave_together(store, rank, world_size, options.timeout_s, key="bench-left",
                       outcome=f"failed: {type(exc).__name__}")
        raise
    else:
        late = leave_together(store, rank, world_size, options.timeout_s, key="bench-left")
        if late:
            results["reshard"]["problems"].append(f"rank {rank}: ranks {late} did not finish within "
                                                  f"{options.timeout_s} s")
    finally:
        transport.abort()  # every rank is done with this world (leave_together): nothing is in flight
    return {
        "rank": rank,
        "fingerprint": plans.plan.fingerprint,
        "p2p_pair_seconds": p2p_pair,
        "p2p_all_seconds": p2p_all,
        "p2p_bytes": options.p2p_bytes,
        "p2p_pairs": world_size // 2,
        "gather_broadcast_bytes": plans.plan.stats.gather_broadcast_bytes,
        "max_rss_bytes": _max_rss(),
        **results,
    }


def _max_rss() -> int:
    """This process's peak resident memory in bytes (what the bench's estimate must cover)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
