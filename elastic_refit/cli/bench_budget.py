"""What `elastic-refit bench` will hold and how long its waits may last, from its plans (pure).

Memory, per rank and method (every method the benchmark runs is counted, FP8 included):

- buffers: the rank's source and destination buffers, and the FP8 destination's (weights and
  scales) when the bench also runs the refit into a quantized format;
- staging: the reshard's (``staging_bytes``), the FP8 reshard's (its own executor, as much
  again) and the sender's FP8 copy of its quantized source buffers (``SourceQuantizer``'s
  arena: one byte an element plus the scales);
- baseline: gather-and-broadcast's staging (a whole tensor on the ranks of a broadcast chain)
  and its two chunks;
- transient: the raw send/recv message, or the pattern and quantizer slabs (bounded);
- process: the interpreter and torch of each rank.

Time: each rank's share of each method (the bytes it sends and receives, the bytes it
quantizes) and of the checks after a run (the pattern check of the first run, the reference
quantizer for FP8, SHA-1 for later runs), at conservative rates for this machine's cores (CPU
work of all ranks at once shares them). A wait on a peer lasts at most the slowest rank's run
and check (a destination waits while a sender quantizes; every rank waits at the next run's
barrier while the slowest checks), so the per-operation timeout is a few times that, never
below a minute; the whole benchmark's deadline adds every run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from elastic_refit.cli._output import format_bytes, format_seconds
from elastic_refit.layout import DTYPE_ITEMSIZE, DTYPES, Layout
from elastic_refit.plan import Plan

__all__ = ["PROCESS_BYTES", "BenchBudget", "RankMemory", "Rates", "estimate"]

MiB = 1 << 20
PROCESS_BYTES = 320 * MiB  # interpreter, torch and a gloo group per rank (private pages)
_SLAB_BYTES = 256 * MiB  # pattern checks and the quantizer work in slabs of 4 Mi elements
_SAFETY = 3.0  # waits may last this many times the estimate
_MIN_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Rates:
    """Work per second of one rank with a core to itself: bytes moved (send + receive),
    elements of pattern made or checked, BF16 bytes quantized, bytes hashed (SHA-1)."""

    moved: float = 1e9
    pattern: float = 12e6
    quantize: float = 50e6
    sha1: float = 1e9

    def __post_init__(self) -> None:
        for name in ("moved", "pattern", "quantize", "sha1"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rate {name} must be > 0, got {getattr(self, name)!r}")


# Measured on this 2-core machine under load (issue 38): gloo moved the 2-layer
# Qwen3-30B-A3B cut's reshard at ~1 GB/s a rank, the pattern ~16 M elements/s, the reference
# quantizer ~60 MB/s of BF16, SHA-1 ~1.9 GB/s a core; the rates sit a little below.
CPU_RATES = Rates()
# NCCL on a GPU: transfers and the pattern on the device; the FP8 check's reference
# quantizer stays on the CPU.
CUDA_RATES = Rates(moved=2e9, pattern=1e9, quantize=50e6, sha1=1e9)


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Bytes one rank holds at its peak (module docstring), by part."""

    rank: int
    buffers: int
    staging: int
    baseline: int
    transient: int
    process: int = PROCESS_BYTES

    @property
    def total(self) -> int:
        return self.buffers + self.staging + self.baseline + self.transient + self.process

    @property
    def device(self) -> int:
        """What lives on the rank's device when it has one (all but the process)."""
        return self.total - self.process


@dataclass(frozen=True, slots=True)
class BenchBudget:
    """The benchmark's memory (per rank) and time: per method, the seconds one run and its
    check may take on the slowest rank; the per-operation timeout; the whole deadline."""

    ranks: tuple[RankMemory, ...]
    run_seconds: dict[str, float] = field(hash=False)
    check_seconds: dict[str, float] = field(hash=False)
    fill_seconds: float = 0.0
    timeout_s: float = _MIN_TIMEOUT_S
    total_s: float = 0.0

    @property
    def memory(self) -> int:
        return sum(r.total for r in self.ranks)

    def part(self, name: str) -> int:
        return sum(getattr(r, name) for r in self.ranks)

    def describe_memory(self) -> str:
        parts = ", ".join(f"{name} {format_bytes(self.part(name))}"
                          for name in ("buffers", "staging", "baseline", "transient", "process"))
        return f"about {format_bytes(self.memory)} ({parts})"

    def describe_time(self) -> str:
        slowest = max(self.run_seconds, key=lambda m: self.run_seconds[m] + self.check_seconds[m])
        return (f"timeout {format_seconds(self.timeout_s)} per operation (the slowest run, {slowest}, "
                f"estimated {format_seconds(self.run_seconds[slowest] + self.check_seconds[slowest])} with its check)")

    def as_dict(self) -> dict[str, object]:
        return {"memory_bytes": self.memory, "max_rank_bytes": max(r.total for r in self.ranks),
                "rank_bytes": [r.total for r in self.ranks],
                **{f"{name}_bytes": self.part(name) for name in ("buffers", "staging", "baseline", "transient",
                                                                 "process")},
                "run_seconds": dict(self.run_seconds), "check_seconds": dict(self.check_seconds),
                "timeout_s": self.timeout_s, "total_s": self.total_s}


def _buffer_bytes(layout: Layout, num_ranks: int) -> np.ndarray:
    """Bytes of every buffer, summed per rank (padding included)."""
    itemsize = np.array([DTYPE_ITEMSIZE[d] for d in DTYPES], dtype=np.int64)
    nbytes = np.prod(layout.buffer_shape, axis=1) * itemsize[layout.buffer_dtype] if layout.num_buffers \
        else np.zeros(0, dtype=np.int64)
    return np.bincount(layout.buffer_rank, weights=nbytes, minlength=num_ranks).astype(np.int64)


def _elements(layout: Layout, num_ranks: int, names: set[str] | None = None) -> np.ndarray:
    """Elements of every piece (of the tensors in ``names``: None, all), summed per rank."""
    keep = np.ones(layout.num_pieces, dtype=bool) if names is None else np.isin(
        layout.piece_tensor, [i for i, t in enumerate(layout.tensors) if t.name in names])
    if not keep.any():
        return np.zeros(num_ranks, dtype=np.int64)
    numel = np.prod(layout.piece_lengths[keep], axis=1)
    return np.bincount(layout.piece_rank[keep], weights=numel, minlength=num_ranks).astype(np.int64)


def _copies(fp8: Plan, plan: Plan, num_ranks: int) -> np.ndarray:
    """Per rank, the FP8 source buffers that are copies (FP8 weights and scales), not the
    caller's: those ``fp8.source`` names in another dtype than ``plan.source``, or only it."""
    held = {(int(plan.source.buffer_rank[b]), plan.source.buffer_names[int(plan.source.buffer_name[b])],
             int(plan.source.buffer_dtype[b])) for b in range(plan.source.num_buffers)}
    src = fp8.source
    out = np.zeros(num_ranks, dtype=np.int64)
    for b in range(src.num_buffers):
        key = (int(src.buffer_rank[b]), src.buffer_names[int(src.buffer_name[b])], int(src.buffer_dtype[b]))
        if key not in held:
            buf = src.buffer(b)
            out[key[0]] += math.prod(buf.shape) * DTYPE_ITEMSIZE[buf.dtype]
    return out


def _moved(plan: Plan) -> np.ndarray:
    """Bytes each rank sends and receives in a reshard of ``plan`` (local copies included)."""
    n = plan.topology.num_ranks
    t = plan.transfers
    local = np.bincount(t.dst_rank[t.kind == 0], weights=(t.nbytes * t.instances)[t.kind == 0], minlength=n) \
        if len(t) else np.zeros(n)
    return (plan.network_send_bytes + plan.network_recv_bytes + plan.intra_send_bytes + plan.intra_recv_bytes
            + local.astype(np.int64))


def _baseline(plan: Plan, chunk_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Per rank: gather-and-broadcast's staging (its largest whole tensor, two chunks) and the
    bytes it sends and receives."""
    from elastic_refit.transport.baseline import BaselineOptions, build_baseline_schedule

    n = plan.topology.num_ranks
    staging, moved = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    options = BaselineOptions(chunk_bytes=chunk_bytes)
    for rank in range(n):
        ops = build_baseline_schedule(plan, rank, options)
        chain = [op.nbytes for op in ops if op.chunks or op.own or op.gather_recv or op.copy_out]
        staging[rank] = max(chain, default=0) + (2 * chunk_bytes if chain else 0)
        for op in ops:
            moved[rank] += sum(it.region.nbytes for it in (*op.gather_send, *op.gather_recv))
            if op.chunks:
                moved[rank] += op.nbytes * ((op.succ is not None) + (op.pred is not None))
    return staging, moved


def _staging(plan: Plan, budget: int) -> np.ndarray:
    """Per rank, the staging an executor of ``plan`` holds: buffers of up to a bucket (never
    more than the rank moves), as many as its budget allows (four per concurrent round)."""
    bucket = plan.options.bucket_bytes
    slots = max(1, budget // bucket) if bucket else 4
    return np.minimum(budget, slots * np.minimum(bucket, _moved(plan)) + 4096).astype(np.int64)


def estimate(plan: Plan, fp8: Plan | None, *, methods: Sequence[str], staging_bytes: int, chunk_bytes: int,
             p2p_bytes: int, runs: int, cores: int, device: str = "cpu") -> BenchBudget:
    """The budget of a benchmark of ``plan`` (and ``fp8``, the same refit into a quantized
    destination, when it runs) with ``methods`` (``bench_refit.METHODS``), ``runs`` runs of
    each (warm-ups included), on ``cores`` cores (``device``: ``"cpu"`` or ``"cuda"``)."""
    n = plan.topology.num_ranks
    rates = CUDA_RATES if device == "cuda" else CPU_RATES

    def share(ranks: int) -> float:
        """How much slower ``ranks`` ranks working at once on the CPU's cores each go."""
        return max(1.0, ranks / max(cores, 1)) if device == "cpu" else 1.0

    src_bytes, dst_bytes = _buffer_bytes(plan.source, n), _buffer_bytes(plan.destination, n)
    base_staging, base_moved = _baseline(plan, chunk_bytes)
    pairs = 2 * (n // 2)  # ranks in the raw send/recv measurement
    dst_elements = _elements(plan.destination, n)
    # a slab's int64 temporaries: ~64 bytes an element, of at most 4 Mi elements
    slabs = np.minimum(_SLAB_BYTES, 64 * (_elements(plan.source, n) + dst_elements))
    transient = np.maximum(slabs, np.where(np.arange(n) < pairs, p2p_bytes, 0))
    buffers = src_bytes + dst_bytes
    staging = _staging(plan, staging_bytes)
    run = {"reshard": _moved(plan) / rates.moved, "gather_broadcast": base_moved / rates.moved}
    check = {"reshard": dst_elements / rates.pattern + dst_bytes / rates.sha1 * runs}
    check["gather_broadcast"] = check["reshard"]
    if "reshard_checked" in methods:  # the source digests before and after (compiled: sha1's pace)
        run["reshard_checked"] = run["reshard"] + 2 * src_bytes / rates.sha1
        check["reshard_checked"] = check["reshard"]
    if fp8 is not None and "reshard_fp8" in methods:
        fp8_dst = _buffer_bytes(fp8.destination, n)
        copies = _copies(fp8, plan, n)
        buffers = buffers + fp8_dst
        staging = staging + _staging(fp8, staging_bytes) + copies
        quantized = set(fp8.quantization.scale_tensor)  # type: ignore[attr-defined]
        q_src = _elements(plan.source, n, quantized) * 2  # BF16 bytes a sender quantizes, at most
        q_dst = _elements(plan.destination, n, quantized)
        run["reshard_fp8"] = _moved(fp8) / rates.moved + q_src / rates.quantize
        check["reshard_fp8"] = (q_dst * 2 / rates.quantize + dst_elements / rates.pattern
                                + fp8_dst / rates.sha1 * runs)
    ranks = tuple(RankMemory(r, int(buffers[r]), int(staging[r]), int(base_staging[r]), int(transient[r]))
                  for r in range(n))
    senders, receivers = len(plan.source.ranks), len(plan.destination.ranks)
    run_s = {m: float(run[m].max(initial=0)) * share(n) for m in methods if m in run}
    check_s = {m: float(check[m].max(initial=0)) * share(receivers) for m in methods if m in check}
    fill_s = float(_elements(plan.source, n).max(initial=0)) / rates.pattern * share(senders)
    worst = max(run_s[m] + check_s[m] for m in run_s)
    timeout = max(_MIN_TIMEOUT_S, _SAFETY * max(worst, fill_s) + 30.0)
    total = 120.0 + _SAFETY * (fill_s + runs * sum(run_s[m] + check_s[m] for m in run_s)) + 2 * timeout
    return BenchBudget(ranks, run_s, check_s, fill_s, timeout, total)

