"""The executor: move one rank's share of a plan over a ``Transport``.

Per step (a round of a phase) a rank sends at most one message and receives at most one.
The plan's ``concurrent_rounds`` consecutive rounds of a phase form a window, and a window's
messages are in flight together: for each bucket index, one batch posts that bucket of every
message of the window (one NCCL group). A bucket is packed with one kernel launch into a
staging buffer, or sent straight from the parameter when it is one contiguous box; each
message that packs has two staging buffers, which overlap packing, transfer and unpacking.
Staging is at most four buckets per round of the window (plus digest trailers), and the
executor refuses a plan whose windows need more than ``staging_bytes``.

Relayed plans add forwards: a rank that receives a network message forwards bucket ``i - 1``
of it over the domain, straight from where it arrived (one operation per run of bytes), in
the batch that carries bucket ``i``, so NVLink works while the NIC does; a needer receives
each run into its parameter when it is one contiguous box there, else into one staging
buffer that is unpacked. Staging stays bounded: two buffers per packing message and one
per forward that needs staging, per window. With verification on, a forward carries the
digests its boxes arrived with at the relay (the relay checked them; nothing is recomputed),
and the needer checks every box where it landed before unpacking staging.

Plans in a quantized destination format (``Plan.quantization``): the caller passes its BF16
source buffers, and before its first message a sender quantizes every source piece it sends
from into FP8 and scale staging (:class:`~elastic_refit.transport.source_quant.SourceQuantizer`);
the plan's rows then move those bytes like any others.

Any failure aborts the transport so peers fail fast, and every rank ends with a vote, so a
rank whose own transfers all succeeded still learns that the refit did not.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import structlog
import torch

from elastic_refit.errors import TransferRefused, VerificationFailed, brief
from elastic_refit.kernels import BoxRegion, PackProgram
from elastic_refit.layout import DTYPE_ITEMSIZE
from elastic_refit.log import ensure_configured
from elastic_refit.plan import Plan
from elastic_refit.transport.buffers import byte_view, digest, resolve_buffers
from elastic_refit.transport.protocol import P2POp, Transport, Work
from elastic_refit.transport.schedule import (
    STAGED,
    BoxCopy,
    Bucket,
    BufferRef,
    Forward,
    ForwardPart,
    Message,
    RankSchedule,
    Step,
    build_rank_schedule,
)
from elastic_refit.transport.source_quant import SourceQuantizer

log = structlog.get_logger("elastic_refit.transport")  # lazy: follows whatever configuration is current

MiB = 1 << 20
DIGEST_BYTES = 8
# Forwards between a pair are told apart from its network buckets by tag (gloo matches on it).
FORWARD_TAG = 1 << 20


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
        # Boxes a relay only stages have no buffer here: they are forwarded, not unpacked.
        own = [b for b in bucket.boxes if b.buffer != STAGED]
        refs: list[BufferRef] = []
        for b in own:
            if b.buffer not in refs:
                refs.append(b.buffer)
        self.refs = refs
        specs = [schedule.buffers[r] for r in refs]
        self.direct: tuple[BufferRef, int, int] | None = None
        if options.zero_copy and not options.verify and len(bucket.boxes) == 1 and own:
            only = bucket.boxes[0]
            spec = schedule.buffers[only.buffer]
            span = _contiguous_span(spec.shape, only, DTYPE_ITEMSIZE[spec.dtype])
            if span is not None:
                self.direct = (only.buffer, span[0], span[1])
        self.program = None
        if self.direct is None and own:  # a direct bucket needs no kernel program
            self.program = PackProgram(
                [s.shape for s in specs], [getattr(torch, s.dtype) for s in specs],
                [BoxRegion(refs.index(b.buffer), b.offsets, b.lengths, b.packed_offset) for b in own],
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
                _check_digest(where, b, data[b.packed_offset : b.packed_offset + b.nbytes], trailer[i])
        if self.program is not None:
            self._bound(tensors, data).unpack()
        return len(self.bucket.boxes) if verify else 0


def _check_digest(where: str, box: BoxCopy, data: torch.Tensor, want: torch.Tensor | int) -> None:
    """``VerificationFailed`` naming the box and its buffer when ``data`` (the box's bytes
    as they arrived) does not have the digest its sender sent."""
    got = digest(data)
    if int(got) != int(want):
        raise VerificationFailed(f"{where}: box {box.offsets}+{box.lengths} of buffer {box.buffer[1]!r} "
                                 f"arrived with digest {int(got):#x}, sender had {int(want):#x}")


class _ForwardIn:
    """A needer's side of one forward part: where each span lands (straight in a parameter
    when it is one contiguous box there, else at its place in a staging buffer) and the
    program that unpacks what landed in staging (None when nothing does). With verification
    on, the digests the relay passes on land in ``digests`` (one per box, in the part's
    order), and ``check`` compares them with the boxes where they landed, before staging is
    unpacked: verified forwards need no more staging than unverified ones."""

    def __init__(self, part: ForwardPart, schedule: RankSchedule, options: ExecutorOptions,
                 device: torch.device) -> None:
        assert part.boxes is not None
        self.part = part
        self.spans: list[tuple[tuple[BufferRef, int, int] | None, int, int]] = []
        self.landing: list[tuple[BufferRef, int, int] | None] = []  # per box: its direct span, or None (staged)
        staged: list[BoxCopy] = []
        for offset, nbytes in part.spans:
            inside = [b for b in part.boxes.boxes if offset <= b.packed_offset < offset + nbytes]
            direct = None
            if options.zero_copy and len(inside) == 1:
                spec = schedule.buffers[inside[0].buffer]
                span = _contiguous_span(spec.shape, inside[0], DTYPE_ITEMSIZE[spec.dtype])
                direct = None if span is None else (inside[0].buffer, span[0], span[1])
            self.spans.append((direct, offset, nbytes))
            self.landing.extend([direct] if direct is not None else [None] * len(inside))
            if direct is None:
                staged.extend(inside)
        self.io = None if not staged else _BucketIO(
            Bucket(part.nbytes, tuple(staged)), schedule,
            dataclasses.replace(options, zero_copy=False, verify=False), device)
        self.digests = (torch.empty(len(part.boxes.boxes), dtype=torch.int64, device=device)
                        if options.verify else None)

    def check(self, tensors: Mapping[BufferRef, torch.Tensor], staging: torch.Tensor | None, where: str) -> int:
        """Compare every box's digest where it landed with the one the relay passed on;
        returns the boxes checked."""
        assert self.part.boxes is not None and self.digests is not None
        for box, direct, want in zip(self.part.boxes.boxes, self.landing, self.digests, strict=True):
            data = (_BucketIO.direct_view_of(tensors, direct) if direct is not None
                    else staging[box.packed_offset : box.packed_offset + box.nbytes])  # type: ignore[index]
            _check_digest(where, box, data, want)
        return len(self.landing)


@dataclass(slots=True, eq=False)
class _Op:
    """One send or receive of a window's batch: the operation, what its wait is called
    (``"send (phase ... round ...)"``), the bucket it carries when it is a message's (None
    for a forward's span or digests), and its handle while it is in flight."""

    op: P2POp
    what: str
    io: _BucketIO | None = None
    work: Work | None = None

    @property
    def pending(self) -> bool:
        """Posted and not waited for yet."""
        return self.work is not None

    def wait(self, transport: Transport) -> None:
        transport.wait(self.work, self.op.peer, self.what)  # type: ignore[arg-type]
        self.work = None


@dataclass(slots=True, eq=False)
class _Message:
    """A message this rank sends or receives in a window: bucket ``i`` travels in batch
    ``i`` through slot ``i % 2``; ``slots`` holds the operation last posted in each (a
    received bucket's bytes are read there after its wait, by a relay's forwards).
    ``first_slot``: its first staging buffer, when any of its buckets packs."""

    msg: Message
    place: str
    first_slot: int | None
    slots: list[_Op | None] = field(default_factory=lambda: [None, None])


@dataclass(slots=True, eq=False)
class _ForwardRecord:
    """A forward this rank sends (from ``source``, the message it relays) or receives in a
    window: its parts by network bucket, the operations of the part in flight, and (a
    needer's) where that part lands (its ``_ForwardIn`` and staging, None when nothing is
    staged). ``first_slot``: its staging buffer, when it gathers into one."""

    forward: Forward
    place: str
    parts: dict[int, ForwardPart]
    first_slot: int | None = None
    source: _Message | None = None
    ops: list[_Op] = field(default_factory=list)
    landing: tuple[_ForwardIn, torch.Tensor | None] | None = None


@dataclass(frozen=True, slots=True)
class _Window:
    """The records of one window's messages and forwards, in the order their operations
    are posted in each batch (sends, receives, forwards sent, forwards received)."""

    sends: list[_Message]
    recvs: list[_Message]
    forward_sends: list[_ForwardRecord]
    forward_recvs: list[_ForwardRecord]

    @classmethod
    def of(cls, window: tuple[Step, ...], slots: dict[int, int]) -> _Window:
        def place(s: Step) -> str:
            return f"phase {s.phase.name} round {s.round}"

        sends = [_Message(s.send, place(s), slots.get(id(s.send))) for s in window if s.send is not None]
        recvs = [_Message(s.recv, place(s), slots.get(id(s.recv))) for s in window if s.recv is not None]
        received = {id(m.msg): m for m in recvs}
        forward_sends = [_ForwardRecord(f, f"forward to rank {f.peer} of round {s.round}", {p.bucket: p for p in f.parts},
                                        source=received[id(s.recv)])
                         for s in window for f in s.forward_sends]
        forward_recvs = [_ForwardRecord(f, f"forward from rank {f.peer} of round {s.round}",
                                        {p.bucket: p for p in f.parts}, slots.get(id(f)))
                         for s in window for f in s.forward_recvs]
        return cls(sends, recvs, forward_sends, forward_recvs)

    @property
    def relayed(self) -> list[_Message]:
        """The received messages this rank forwards from, in receive order."""
        return [m for m in self.recvs if any(f.source is m for f in self.forward_sends)]

    @property
    def num_batches(self) -> int:
        """Batches of the window: one per bucket index, plus one for the last forwards."""
        return 1 + max([len(m.msg.buckets) for m in self.sends + self.recvs]
                       + [p.bucket + 1 for f in self.forward_recvs + self.forward_sends for p in f.forward.parts])


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
        self._forward_in: dict[int, _ForwardIn] = {}
        for step in self.schedule.steps:
            for msg in (step.send, step.recv):
                if msg is not None:
                    for bucket in msg.buckets:
                        self._io[id(bucket)] = _BucketIO(bucket, self.schedule, self.options, self.device)
            for forward in step.forward_recvs:
                for part in forward.parts:
                    self._forward_in[id(part)] = _ForwardIn(part, self.schedule, self.options, self.device)
        self.windows = _windows(self.schedule.steps, plan.options.concurrent_rounds)
        staged = [io.wire_bytes for io in self._io.values() if io.direct is None]
        staged += [f.part.nbytes for f in self._forward_in.values() if f.io is not None]
        self.max_wire_bytes = max(staged, default=0)
        # Each message that packs holds two staging buffers for as long as its window runs,
        # and each forward received partly into staging one (a relay forwards straight from
        # where its bytes arrived): message or forward id -> its first buffer, per window
        # (sends first), fixed for the epoch.
        self._slots: list[dict[int, int]] = []
        num_slots = [0]
        for window in self.windows:
            messages = [s.send for s in window if s.send] + [s.recv for s in window if s.recv]
            packing = [m for m in messages if any(self._io[id(b)].direct is None for b in m.buckets)]
            slots = {id(m): 2 * k for k, m in enumerate(packing)}
            gathering = [f for s in window for f in s.forward_recvs
                         if any(self._forward_in[id(p)].io is not None for p in f.parts)]
            slots.update({id(f): 2 * len(packing) + k for k, f in enumerate(gathering)})
            self._slots.append(slots)
            num_slots.append(2 * len(packing) + len(gathering))
        self.num_staging_slots = max(num_slots)
        needed = self.num_staging_slots * _aligned(self.max_wire_bytes)
        if needed > self.options.staging_bytes:
            rounds = plan.options.concurrent_rounds
            raise ValueError(
                f"rank {self.rank}: buckets of up to {self.max_wire_bytes} bytes in windows of {rounds} "
                f"round(s) need {needed} bytes of staging ({self.num_staging_slots} buffers), above the "
                f"budget of {self.options.staging_bytes}; plan with PlanOptions(bucket_bytes <= "
                # forwards of relayed plans may need more buffers than four per round
                f"{self.options.staging_bytes // max(4 * rounds, self.num_staging_slots)}) or fewer "
                f"concurrent_rounds, or give more staging"
            )
        self._staging: list[torch.Tensor] = []
        self._quantizer = (SourceQuantizer(plan, self.rank, self.device, self.options.pack_backend)
                           if plan.quantization is not None else None)
        # Only the ranks with pieces in the plan take part (a catch-up refit may leave the
        # trainers out of an epoch's communicator).
        self.participants = tuple(sorted(set(plan.source.ranks) | set(plan.destination.ranks)))

    # ---- public ----------------------------------------------------------------------
    @property
    def staging_allocated(self) -> int:
        return sum(t.numel() for t in self._staging)

    def run(self, source: Mapping[str, torch.Tensor] | None = None,
            destination: Mapping[str, torch.Tensor] | None = None, *,
            before_vote: Callable[[], None] | None = None) -> TransferReport:
        """Move this rank's bytes: ``source`` and ``destination`` map buffer names to tensors.

        ``before_vote`` runs once this rank's sends and receives are done, before its
        closing vote; if it raises, this rank votes no (every participant then fails the
        refit, the communicator stays usable) and its exception propagates. A check there
        (e.g. that the sources still hold what was published) is known to every participant
        once the vote passes, without another round trip, and runs while peers finish.

        Raises ``TransportAborted`` when this or any other rank fails, ``ValueError`` for
        missing or mismatched buffers (after aborting the transport so peers do not hang).
        """
        start = time.perf_counter()
        try:
            if self._quantizer is not None:
                source = self._quantizer.run(source or {}, self.transport)
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
            log.warning("transport.executor.failed", rank=self.rank, error=brief(exc))
            self.transport.abort()
            raise
        refused: BaseException | None = None
        if before_vote is not None:
            try:
                before_vote()
            except Exception as exc:
                refused = exc
        if not self.transport.vote(refused is None, self.participants):
            if refused is not None:
                raise refused
            raise TransferRefused(f"rank {self.rank}: another rank voted the refit down at its close",
                                  rank=self.rank, phase="vote")
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
        bucket ``i - 1`` of each is unpacked. ``slots``: each packing message's (and
        gathering forward's) first staging buffer.

        Relayed plans forward bucket ``i - 1`` of a received network message in batch ``i``,
        beside bucket ``i`` of the network message (so NVLink works under the network): the
        relay waits for bucket ``i - 1`` before it posts batch ``i``, and every forward of
        batch ``i`` is done before batch ``i + 1`` reuses its staging. Batch ``i`` waits only
        on batches before it, on every rank, so no rank waits in a cycle."""
        transport = self.transport
        w = _Window.of(window, slots)
        for i in range(w.num_batches):
            prev = (i - 1) % 2
            for m in w.relayed:  # the forwards of bucket i - 1 join this batch: have it first
                if 1 <= i <= len(m.msg.buckets):
                    self._finish_recv(m, prev, tensors, counts)
            # Bucket i of every message goes in one batch: a rank sends to one peer and
            # receives from another, and a backend that connects pairs lazily inside a group
            # (NCCL) would otherwise wait in a cycle of such ranks.
            ops = (self._post_sends(w.sends, i, tensors, counts) + self._post_recvs(w.recvs, i, tensors, counts)
                   + self._post_forward_sends(w.forward_sends, i, counts)
                   + self._post_forward_recvs(w.forward_recvs, i, tensors, counts))
            if ops:
                for op, work in zip(ops, transport.post([op.op for op in ops]), strict=True):
                    op.work = work
            for m in w.recvs:
                if i >= 1 and i - 1 < len(m.msg.buckets) and m.slots[prev] is not None and m.slots[prev].pending:
                    self._finish_recv(m, prev, tensors, counts)
            for f in w.forward_recvs:
                self._finish_forward_recv(f, tensors, counts)
            for f in w.forward_sends:
                for op in f.ops:  # the bytes' staging is reused by batch i + 1
                    op.wait(transport)
                f.ops = []
        for m in w.sends:
            for op in m.slots:
                if op is not None and op.pending:
                    op.wait(transport)

    def _staging_of(self, first_slot: int | None, slot: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of staging buffer ``slot`` (0 or 1) of a packing message."""
        return self._staging[first_slot + slot][:nbytes]  # type: ignore[operator]

    def _post_sends(self, sends: list[_Message], i: int, tensors, counts) -> list[_Op]:
        """Bucket ``i`` of every message this rank sends: packed into its staging slot once
        that slot's previous send is done, or straight from the parameter."""
        ops = []
        slot = i % 2
        for m in sends:
            if i >= len(m.msg.buckets):
                continue
            io = self._io[id(m.msg.buckets[i])]
            prior = m.slots[slot]
            if prior is not None and prior.pending:  # the staging slot is free once its send is done
                prior.wait(self.transport)
            if io.direct is not None:
                payload = io.direct_view(tensors)
                counts["num_zero_copy_buckets"] += 1
            else:
                payload = self._staging_of(m.first_slot, slot, io.wire_bytes)
                io.pack(tensors, payload, self.options.verify)
            m.slots[slot] = _Op(P2POp("send", payload, m.msg.peer, i), f"send ({m.place})", io)
            ops.append(m.slots[slot])
            counts["num_buckets"] += 1
        return ops

    def _post_recvs(self, recvs: list[_Message], i: int, tensors, counts) -> list[_Op]:
        """Bucket ``i`` of every message this rank receives: into its staging slot, or
        straight into the parameter."""
        ops = []
        slot = i % 2
        for m in recvs:
            if i >= len(m.msg.buckets):
                continue
            io = self._io[id(m.msg.buckets[i])]
            target = (io.direct_view(tensors) if io.direct is not None
                      else self._staging_of(m.first_slot, slot, io.wire_bytes))
            m.slots[slot] = _Op(P2POp("recv", target, m.msg.peer, i), f"receive ({m.place})", io)
            ops.append(m.slots[slot])
            counts["num_buckets"] += 1
        return ops

    def _post_forward_sends(self, forwards: list[_ForwardRecord], i: int, counts) -> list[_Op]:
        """A relay's forwards of bucket ``i - 1``: each span straight from where it arrived
        (that bucket was received before this batch), then, with verification on, the
        digests its boxes arrived with (checked then)."""
        ops = []
        for f in forwards:
            part = f.parts.get(i - 1)
            if part is None:
                continue
            arrived = f.source.slots[(i - 1) % 2]  # type: ignore[union-attr]
            io, data = arrived.io, arrived.op.tensor  # type: ignore[union-attr]
            payloads = [data[offset : offset + nbytes] for offset, nbytes in part.spans]
            if self.options.verify:
                trailer = data[io.trailer_offset : io.wire_bytes].view(torch.int64)
                payloads.append(trailer[list(part.digests)].view(torch.uint8))
            f.ops = [_Op(P2POp("send", payload, f.forward.peer, FORWARD_TAG + i - 1), f"send ({f.place})")
                     for payload in payloads]
            ops += f.ops
            counts["num_buckets"] += 1
        return ops

    def _post_forward_recvs(self, forwards: list[_ForwardRecord], i: int, tensors, counts) -> list[_Op]:
        """A needer's receives of bucket ``i - 1``'s forwards: each span straight into the
        parameter when it is one contiguous box there, else at its place in staging; then,
        with verification on, the digests the boxes came with at the relay."""
        ops = []
        for f in forwards:
            part = f.parts.get(i - 1)
            if part is None:
                continue
            arrival = self._forward_in[id(part)]
            staging = None if arrival.io is None else self._staging_of(f.first_slot, 0, part.nbytes)
            targets = []
            for direct, offset, nbytes in arrival.spans:
                if direct is not None:
                    targets.append(_BucketIO.direct_view_of(tensors, direct))
                    counts["num_zero_copy_buckets"] += 1
                else:
                    targets.append(staging[offset : offset + nbytes])  # type: ignore[index]
            if self.options.verify:
                targets.append(arrival.digests.view(torch.uint8))  # type: ignore[union-attr]
            f.ops = [_Op(P2POp("recv", target, f.forward.peer, FORWARD_TAG + i - 1), f"receive ({f.place})")
                     for target in targets]
            ops += f.ops
            f.landing = (arrival, staging)
            counts["num_buckets"] += 1
        return ops

    def _finish_recv(self, m: _Message, slot: int, tensors, counts) -> None:
        """Wait for the bucket in flight in ``slot`` of received message ``m`` and unpack it
        (a bucket received straight into its parameter has nothing to unpack). Its bytes
        stay where they arrived: a relay forwards them from there in the next batch."""
        op = m.slots[slot]
        assert op is not None and op.io is not None
        op.wait(self.transport)
        if op.io.direct is None:
            counts["num_verified_boxes"] += op.io.unpack(tensors, op.op.tensor, self.options.verify,
                                                         f"rank {self.rank} {m.place}")
        else:
            counts["num_zero_copy_buckets"] += 1

    def _finish_forward_recv(self, f: _ForwardRecord, tensors, counts) -> None:
        """Wait for the part of forward ``f`` in flight (if any), check its digests where
        the boxes landed, then unpack what landed in staging."""
        if not f.ops:
            return
        for op in f.ops:
            op.wait(self.transport)
        arrival, staging = f.landing  # type: ignore[misc]
        where = f"rank {self.rank} {f.place}"
        if self.options.verify:  # before anything is unpacked from staging
            counts["num_verified_boxes"] += arrival.check(tensors, staging, where)
        if arrival.io is not None:
            arrival.io.unpack(tensors, staging, False, where)
        f.ops = []


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def _windows(steps: tuple[Step, ...], concurrent_rounds: int) -> tuple[tuple[Step, ...], ...]:
    """This rank's steps cut into the plan's windows: ``concurrent_rounds`` consecutive rounds
    of one phase (numbered alike on every rank, so every rank opens the same windows)."""
    windows: dict[tuple[int, int], list[Step]] = {}
    for step in steps:
        windows.setdefault((int(step.phase), step.round // concurrent_rounds), []).append(step)
    return tuple(tuple(w) for _, w in sorted(windows.items()))
