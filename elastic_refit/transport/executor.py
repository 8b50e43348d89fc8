"""The executor: move one rank's share of a plan over a ``Transport``.

Per step (a round of a phase) a rank sends at most one message and receives at most one.
The plan's ``concurrent_rounds`` consecutive rounds of a phase form a window, and a window's
messages are in flight together: for each bucket index, one batch posts that bucket of every
message of the window (one NCCL group). A bucket is packed with one kernel launch into a
staging buffer, or sent straight from the parameter when it is one contiguous box; each
message that packs has two staging buffers, which overlap packing, transfer and unpacking.
Staging is at most four buckets per round of the window (plus digest trailers), and the
executor refuses a plan whose windows need more than ``staging_bytes``.

Any failure aborts the transport so peers fail fast, and every rank ends with a vote, so a
rank whose own transfers all succeeded still learns that the refit did not.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import structlog
import torch

from elastic_refit.errors import TransportAborted, VerificationFailed
from elastic_refit.kernels import BoxRegion, PackProgram
from elastic_refit.layout import DTYPE_ITEMSIZE
from elastic_refit.log import ensure_configured
from elastic_refit.plan import Plan
from elastic_refit.transport.buffers import byte_view, digest, resolve_buffers
from elastic_refit.transport.protocol import P2POp, Transport
from elastic_refit.transport.schedule import (
    BoxCopy,
    Bucket,
    BufferRef,
    RankSchedule,
    Step,
    build_rank_schedule,
)

log = structlog.get_logger("elastic_refit.transport")  # lazy: follows whatever configuration is current

MiB = 1 << 20
DIGEST_BYTES = 8


@dataclass(frozen=True, slots=True)
class ExecutorOptions:
    """``staging_bytes`` bounds this rank's staging buffers; ``verify`` sends a digest of
    every box with the data and checks it on arrival; ``pack_backend`` picks the kernels."""

    staging_bytes: int = 256 * MiB
    verify: bool = False
    pack_backend: str = "auto"
    zero_copy: bool = True

    def __post_init__(self) -> None:
        if self.staging_bytes < 1:
            raise ValueError(f"staging_bytes must be >= 1, got {self.staging_bytes}")
        if self.pack_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"pack_backend must be auto, torch or triton, got {self.pack_backend!r}")


@dataclass(frozen=True, slots=True)
class TransferReport:
    """What one rank moved in one refit: bytes (``*_bytes``), counts (``num_*``) and the
    wall time (``seconds``). ``num_buckets`` counts buckets sent and received,
    ``num_zero_copy_buckets`` those of them that went straight from or into a parameter,
    ``num_verified_boxes`` the received boxes whose digest was checked."""

    rank: int
    seconds: float
    network_send_bytes: int
    network_recv_bytes: int
    intra_send_bytes: int
    intra_recv_bytes: int
    local_bytes: int
    num_buckets: int
    num_zero_copy_buckets: int
    staging_bytes: int
    num_verified_boxes: int


def _contiguous_span(shape: tuple[int, ...], box: BoxCopy, itemsize: int) -> tuple[int, int] | None:
    """(byte offset, bytes) of a box when it is one contiguous span of its buffer."""
    nd = len(shape)
    lead = 0
    while lead < nd - 1 and box.lengths[lead] == 1:
        lead += 1
    if any(box.lengths[j] != shape[j] for j in range(lead + 1, nd)):
        return None
    stride = itemsize
    offset = 0
    for j in reversed(range(nd)):
        offset += box.offsets[j] * stride
        stride *= shape[j]
    return offset, box.nbytes


class _BucketIO:
    """A bucket bound to this rank's tensors: pack/unpack through a kernel program, or a
    direct view when the bucket is a single contiguous box."""

    def __init__(self, bucket: Bucket, schedule: RankSchedule, options: ExecutorOptions,
                 device: torch.device) -> None:
        self.bucket = bucket
        refs: list[BufferRef] = []
        for b in bucket.boxes:
            if b.buffer not in refs:
                refs.append(b.buffer)
        self.refs = refs
        specs = [schedule.buffers[r] for r in refs]
        self.direct: tuple[BufferRef, int, int] | None = None
        if options.zero_copy and not options.verify and len(bucket.boxes) == 1:
            only = bucket.boxes[0]
            spec = schedule.buffers[only.buffer]
            span = _contiguous_span(spec.shape, only, DTYPE_ITEMSIZE[spec.dtype])
            if span is not None:
                self.direct = (only.buffer, span[0], span[1])
        self.program = None
        if self.direct is None:  # a direct bucket needs no kernel program
            self.program = PackProgram(
                [s.shape for s in specs], [getattr(torch, s.dtype) for s in specs],
                [BoxRegion(refs.index(b.buffer), b.offsets, b.lengths, b.packed_offset) for b in bucket.boxes],
                device=device, backend=options.pack_backend,
            )
        self._bindings: dict[tuple, object] = {}
        # The digest trailer starts 8-byte aligned after the data.
        self.trailer_offset = -(-bucket.nbytes // DIGEST_BYTES) * DIGEST_BYTES
        self.wire_bytes = (self.trailer_offset + DIGEST_BYTES * len(bucket.boxes)) if options.verify else bucket.nbytes

    def direct_view(self, tensors: Mapping[BufferRef, torch.Tensor]) -> torch.Tensor:
        return self.direct_view_of(tensors, self.direct)

    @staticmethod
    def direct_view_of(tensors: Mapping[BufferRef, torch.Tensor], span) -> torch.Tensor:
        ref, offset, nbytes = span
        return byte_view(tensors[ref]).reshape(-1)[offset : offset + nbytes]

    def _bound(self, tensors: Mapping[BufferRef, torch.Tensor], data: torch.Tensor):
        """A kernel binding for these tensors and this staging view: checks run once, later
        refits of the epoch only launch."""
        bound = [tensors[r] for r in self.refs]
        key = (data.data_ptr(), data.numel(), tuple(t.data_ptr() for t in bound))
        binding = self._bindings.get(key)
        if binding is None:
            if len(self._bindings) >= 8:  # staging slots x parameter sets; keep it small
                self._bindings.clear()
            binding = self._bindings[key] = self.program.bind(bound, data)  # type: ignore[union-attr]
        return binding

    def pack(self, tensors: Mapping[BufferRef, torch.Tensor], staging: torch.Tensor, verify: bool) -> None:
        data = staging[: self.bucket.nbytes]
        self._bound(tensors, data).pack()
        if verify:
            trailer = staging[self.trailer_offset : self.wire_bytes].view(torch.int64)
            for i, b in enumerate(self.bucket.boxes):
                trailer[i] = digest(data[b.packed_offset : b.packed_offset + b.nbytes])

    def unpack(self, tensors: Mapping[BufferRef, torch.Tensor], staging: torch.Tensor, verify: bool,
               where: str) -> int:
        data = staging[: self.bucket.nbytes]
        if verify:
            trailer = staging[self.trailer_offset : self.wire_bytes].view(torch.int64)
            for i, b in enumerate(self.bucket.boxes):
                got = digest(data[b.packed_offset : b.packed_offset + b.nbytes])
                if int(got) != int(trailer[i]):
                    raise VerificationFailed(f"{where}: box {b.offsets}+{b.lengths} of buffer {b.buffer[1]!r} "
                                             f"arrived with digest {int(got):#x}, sender had {int(trailer[i]):#x}")
        self._bound(tensors, data).unpack()
        return len(self.bucket.boxes) if verify else 0


class Executor:
    """Runs rank ``rank``'s share of ``plan`` over ``transport``; build once per epoch."""

    def __init__(self, plan: Plan, transport: Transport, options: ExecutorOptions | None = None) -> None:
        ensure_configured()  # structlog's default would print to stdout
        self.plan = plan
        self.transport = transport
        self.options = options or ExecutorOptions()
        self.rank = transport.rank
        self.schedule = build_rank_schedule(plan, self.rank)
        self.device = transport.device
        self._io: dict[int, _BucketIO] = {}
        for step in self.schedule.steps:
            for msg in (step.send, step.recv):
                if msg is not None:
                    for bucket in msg.buckets:
                        self._io[id(bucket)] = _BucketIO(bucket, self.schedule, self.options, self.device)
        self.windows = _windows(self.schedule.steps, plan.options.concurrent_rounds)
        staged = [io.wire_bytes for io in self._io.values() if io.direct is None]
        self.max_wire_bytes = max(staged, default=0)
        # Each message that packs holds two staging buffers for as long as its window runs:
        # message id -> its first buffer, per window (sends first), fixed for the epoch.
        self._slots: list[dict[int, int]] = []
        for window in self.windows:
            messages = [s.send for s in window if s.send] + [s.recv for s in window if s.recv]
            packing = [m for m in messages if any(self._io[id(b)].direct is None for b in m.buckets)]
            self._slots.append({id(m): 2 * k for k, m in enumerate(packing)})
        self.num_staging_slots = max((2 * len(slots) for slots in self._slots), default=0)
        needed = self.num_staging_slots * _aligned(self.max_wire_bytes)
        if needed > self.options.staging_bytes:
            rounds = plan.options.concurrent_rounds
            raise ValueError(
                f"rank {self.rank}: buckets of up to {self.max_wire_bytes} bytes in windows of {rounds} "
                f"round(s) need {needed} bytes of staging ({self.num_staging_slots} buffers), above the "
                f"budget of {self.options.staging_bytes}; plan with PlanOptions(bucket_bytes <= "
                f"{self.options.staging_bytes // (4 * rounds)}) or fewer concurrent_rounds, or give more staging"
            )
        self._staging: list[torch.Tensor] = []
        # Only the ranks with pieces in the plan take part (a catch-up refit may leave the
        # trainers out of an epoch's communicator).
        self.participants = tuple(sorted(set(plan.source.ranks) | set(plan.destination.ranks)))

    # ---- public ----------------------------------------------------------------------
    @property
    def staging_allocated(self) -> int:
        return sum(t.numel() for t in self._staging)

    def run(self, source: Mapping[str, torch.Tensor] | None = None,
            destination: Mapping[str, torch.Tensor] | None = None) -> TransferReport:
        """Move this rank's bytes: ``source`` and ``destination`` map buffer names to tensors.

        Raises ``TransportAborted`` when this or any other rank fails, ``ValueError`` for
        missing or mismatched buffers (after aborting the transport so peers do not hang).
        """
        start = time.perf_counter()
        try:
            tensors = resolve_buffers(self.schedule.buffers, source or {}, destination or {}, rank=self.rank,
                                      device=self.device)
            self._ensure_staging()
            counts = {"num_buckets": 0, "num_zero_copy_buckets": 0, "num_verified_boxes": 0}
            for copy in self.schedule.local_copies:
                self._local_copy(copy, tensors)
            for window, slots in zip(self.windows, self._slots, strict=True):
                self._exchange(window, slots, tensors, counts)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except BaseException as exc:
            log.warning("transport.executor.failed", rank=self.rank, error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            self.transport.abort()
            raise
        if not self.transport.vote(True, self.participants):
            raise TransportAborted(f"rank {self.rank}: another rank failed the refit", rank=self.rank, phase="vote")
        by_kind = self.schedule.bytes_by_kind()
        report = TransferReport(
            rank=self.rank,
            seconds=time.perf_counter() - start,
            network_send_bytes=by_kind["network_send"],
            network_recv_bytes=by_kind["network_recv"],
            intra_send_bytes=by_kind["intra_send"],
            intra_recv_bytes=by_kind["intra_recv"],
            local_bytes=by_kind["local"],
            num_buckets=counts["num_buckets"],
            num_zero_copy_buckets=counts["num_zero_copy_buckets"],
            staging_bytes=self.staging_allocated,
            num_verified_boxes=counts["num_verified_boxes"],
        )
        log.info("transport.executor.done", rank=self.rank, seconds=report.seconds,
                 sent_bytes=self.schedule.send_bytes, recv_bytes=self.schedule.recv_bytes,
                 local_bytes=report.local_bytes, num_buckets=report.num_buckets)
        return report

    # ---- internals ---------------------------------------------------------------------
    def _ensure_staging(self) -> None:
        if not self._staging and self.num_staging_slots:
            # 8-byte aligned so digest trailers can be viewed as int64.
            size = _aligned(self.max_wire_bytes)
            self._staging = [torch.empty(size, dtype=torch.uint8, device=self.device)
                             for _ in range(self.num_staging_slots)]

    def _local_copy(self, copy, tensors) -> None:
        src = tensors[copy.src.buffer][tuple(slice(o, o + n) for o, n in zip(copy.src.offsets, copy.src.lengths, strict=True))]
        dst = tensors[copy.dst.buffer][tuple(slice(o, o + n) for o, n in zip(copy.dst.offsets, copy.dst.lengths, strict=True))]
        dst.copy_(src.reshape(dst.shape))

    def _exchange(self, window: tuple[Step, ...], slots: dict[int, int], tensors, counts) -> None:
        """Move every message of one window: bucket ``i`` of all of them in one batch, while
        bucket ``i - 1`` of each is unpacked. ``slots``: each packing message's first staging
        buffer."""
        transport, verify = self.transport, self.options.verify
        sends = [(s.send, f"phase {s.phase.name} round {s.round}") for s in window if s.send is not None]
        recvs = [(s.recv, f"phase {s.phase.name} round {s.round}") for s in window if s.recv is not None]
        send_work: list[list] = [[None, None] for _ in sends]
        recv_work: list[list] = [[None, None] for _ in recvs]
        recv_target: list[list] = [[None, None] for _ in recvs]
        num_steps = max(len(m.buckets) for m, _ in sends + recvs)
        for i in range(num_steps + 1):
            slot = i % 2
            # Bucket i of every message goes in one batch: a rank sends to one peer and
            # receives from another, and a backend that connects pairs lazily inside a group
            # (NCCL) would otherwise wait in a cycle of such ranks.
            ops: list[P2POp] = []
            posted: list[tuple[list, int]] = []  # (work list, slot) per op, in op order
            for j, (msg, place) in enumerate(sends):
                if i >= len(msg.buckets):
                    continue
                io = self._io[id(msg.buckets[i])]
                if send_work[j][slot] is not None:  # the staging slot is free once its send is done
                    transport.wait(send_work[j][slot], msg.peer, f"send ({place})")
                    send_work[j][slot] = None
                if io.direct is not None:
                    payload = io.direct_view(tensors)
                    counts["num_zero_copy_buckets"] += 1
                else:
                    payload = self._staging[slots[id(msg)] + slot][: io.wire_bytes]
                    io.pack(tensors, payload, verify)
                ops.append(P2POp("send", payload, msg.peer, i))
                posted.append((send_work[j], slot))
                counts["num_buckets"] += 1
            for j, (msg, _) in enumerate(recvs):
                if i >= len(msg.buckets):
                    continue
                io = self._io[id(msg.buckets[i])]
                target = (io.direct_view(tensors) if io.direct is not None
                          else self._staging[slots[id(msg)] + slot][: io.wire_bytes])
                ops.append(P2POp("recv", target, msg.peer, i))
                posted.append((recv_work[j], slot))
                recv_target[j][slot] = (io, target)
                counts["num_buckets"] += 1
            if ops:
                for (work_list, k), work in zip(posted, transport.post(ops), strict=True):
                    work_list[k] = work
            prev = (i - 1) % 2
            for j, (msg, place) in enumerate(recvs):
                if i < 1 or i - 1 >= len(msg.buckets):
                    continue
                transport.wait(recv_work[j][prev], msg.peer, f"receive ({place})")
                io, target = recv_target[j][prev]
                if io.direct is None:
                    counts["num_verified_boxes"] += io.unpack(tensors, target, verify, f"rank {self.rank} {place}")
                else:
                    counts["num_zero_copy_buckets"] += 1
                recv_work[j][prev] = None
        for j, (msg, place) in enumerate(sends):
            for slot in (0, 1):
                if send_work[j][slot] is not None:
                    transport.wait(send_work[j][slot], msg.peer, f"send ({place})")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def _windows(steps: tuple[Step, ...], concurrent_rounds: int) -> tuple[tuple[Step, ...], ...]:
    """This rank's steps cut into the plan's windows: ``concurrent_rounds`` consecutive rounds
    of one phase (numbered alike on every rank, so every rank opens the same windows)."""
    windows: dict[tuple[int, int], list[Step]] = {}
    for step in steps:
        windows.setdefault((int(step.phase), step.round // concurrent_rounds), []).append(step)
    return tuple(tuple(w) for _, w in sorted(windows.items()))
