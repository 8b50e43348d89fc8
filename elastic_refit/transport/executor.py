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
source buffers and the destination's FP8 ``weight`` and scale (``weight_scale_inv``) buffers
(``plan.destination``'s). Before its first message a sender quantizes every source piece it
sends from (``_SourceQuantizer``) into FP8 and scale staging of the epoch (one uint8 arena),
after the plan's partial-amax exchange for blocks split across source shards (one batch of
small messages). Pieces whose blocks are whole go through the fused Triton kernel
(``QuantPackProgram``, built once per epoch: one launch per group of boxes, writing straight
into the staging; ``pack_backend`` "triton", or "auto" on CUDA with Triton installed);
pieces with split blocks, and every piece with ``pack_backend="torch"``, through the
reference quantizer's plain torch ops (``elastic_refit.kernels.quantize``) with the combined
amax. Both give the same bytes. The plan's rows then move FP8 bytes and scales like any others, and
the receiver's unpack places them into its weight and scale buffers. Digests (``verify``) are
of those FP8 bytes and scales, taken on the quantizing sender. A block with NaN or Inf fails
the refit on its sender (``NonFiniteBlockError`` naming the tensor and block).

Any failure aborts the transport so peers fail fast, and every rank ends with a vote, so a
rank whose own transfers all succeeded still learns that the refit did not.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import structlog
import torch

from elastic_refit.errors import TransferRefused, VerificationFailed, brief
from elastic_refit.kernels import BoxRegion, PackProgram, QuantPackProgram, QuantRegion
from elastic_refit.layout import DTYPE_ITEMSIZE
from elastic_refit.log import ensure_configured
from elastic_refit.plan import Plan, SourceSide
from elastic_refit.transport.buffers import byte_view, digest, resolve_buffers
from elastic_refit.transport.protocol import P2POp, Transport
from elastic_refit.transport.schedule import (
    STAGED,
    BoxCopy,
    Bucket,
    BufferRef,
    ForwardPart,
    RankSchedule,
    Step,
    build_rank_schedule,
)

log = structlog.get_logger("elastic_refit.transport")  # lazy: follows whatever configuration is current

MiB = 1 << 20
DIGEST_BYTES = 8
# Forwards between a pair are told apart from its network buckets by tag (gloo matches on it).
FORWARD_TAG = 1 << 20
# Partial-amax messages of quantized plans: this plus the exchange row (same on both ends).
AMAX_TAG = 1 << 22


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
        self._quantizer = (_SourceQuantizer(plan, self.rank, self.device, self.options.pack_backend)
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
        transport, verify = self.transport, self.options.verify
        sends = [(s.send, f"phase {s.phase.name} round {s.round}") for s in window if s.send is not None]
        recvs = [(s.recv, f"phase {s.phase.name} round {s.round}") for s in window if s.recv is not None]
        recv_index = {id(m): j for j, (m, _) in enumerate(recvs)}
        forward_sends = [(f, recv_index[id(s.recv)], f"forward to rank {f.peer} of round {s.round}")
                         for s in window for f in s.forward_sends]
        forward_recvs = [(f, f"forward from rank {f.peer} of round {s.round}")
                         for s in window for f in s.forward_recvs]
        relaying = sorted({j for _, j, _ in forward_sends})  # received messages this rank forwards from
        send_parts = [{p.bucket: p for p in f.parts} for f, _, _ in forward_sends]
        recv_parts = [{p.bucket: p for p in f.parts} for f, _ in forward_recvs]
        send_work: list[list] = [[None, None] for _ in sends]
        recv_work: list[list] = [[None, None] for _ in recvs]
        recv_target: list[list] = [[None, None] for _ in recvs]
        forward_send_work: list[list] = [[] for _ in forward_sends]  # one handle per span in flight
        forward_recv_work: list[list] = [[] for _ in forward_recvs]
        forward_recv_target: list = [None] * len(forward_recvs)
        num_steps = max([len(m.buckets) for m, _ in sends + recvs]
                        + [p.bucket + 1 for f, _ in forward_recvs for p in f.parts]
                        + [p.bucket + 1 for f, _, _ in forward_sends for p in f.parts])

        def finish_recv(j: int, slot: int) -> None:
            msg, place = recvs[j]
            transport.wait(recv_work[j][slot], msg.peer, f"receive ({place})")
            io, target = recv_target[j][slot]
            if io.direct is None:
                counts["num_verified_boxes"] += io.unpack(tensors, target, verify, f"rank {self.rank} {place}")
            else:
                counts["num_zero_copy_buckets"] += 1
            recv_work[j][slot] = None

        for i in range(num_steps + 1):
            slot = i % 2
            prev = (i - 1) % 2
            for j in relaying:  # the forwards of bucket i - 1 join this batch: have it first
                if 1 <= i <= len(recvs[j][0].buckets):
                    finish_recv(j, prev)
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
            for k, (forward, j, _) in enumerate(forward_sends):
                part = send_parts[k].get(i - 1)
                if part is None:
                    continue
                io, data = recv_target[j][prev]
                payloads = [data[offset : offset + nbytes] for offset, nbytes in part.spans]  # straight from arrival
                if verify:  # the digests the boxes arrived with (checked then), after the data
                    trailer = data[io.trailer_offset : io.wire_bytes].view(torch.int64)
                    payloads.append(trailer[list(part.digests)].view(torch.uint8))
                for payload in payloads:
                    ops.append(P2POp("send", payload, forward.peer, FORWARD_TAG + i - 1))
                    posted.append((forward_send_work[k], len(forward_send_work[k])))
                    forward_send_work[k].append(None)
                counts["num_buckets"] += 1
            for k, (forward, _) in enumerate(forward_recvs):
                part = recv_parts[k].get(i - 1)
                if part is None:
                    continue
                arrival = self._forward_in[id(part)]
                staging = None if arrival.io is None else self._staging[slots[id(forward)]][: part.nbytes]
                targets = []
                for direct, offset, nbytes in arrival.spans:
                    if direct is not None:
                        targets.append(_BucketIO.direct_view_of(tensors, direct))
                        counts["num_zero_copy_buckets"] += 1
                    else:
                        targets.append(staging[offset : offset + nbytes])  # type: ignore[index]
                if verify:  # the digests the boxes came with at the relay, after the data
                    targets.append(arrival.digests.view(torch.uint8))  # type: ignore[union-attr]
                for target in targets:
                    ops.append(P2POp("recv", target, forward.peer, FORWARD_TAG + i - 1))
                    posted.append((forward_recv_work[k], len(forward_recv_work[k])))
                    forward_recv_work[k].append(None)
                forward_recv_target[k] = (arrival, staging)
                counts["num_buckets"] += 1
            if ops:
                for (work_list, k), work in zip(posted, transport.post(ops), strict=True):
                    work_list[k] = work
            for j in range(len(recvs)):
                if i >= 1 and i - 1 < len(recvs[j][0].buckets) and recv_work[j][prev] is not None:
                    finish_recv(j, prev)
            for k, (forward, place) in enumerate(forward_recvs):
                if not forward_recv_work[k]:
                    continue
                for work in forward_recv_work[k]:
                    transport.wait(work, forward.peer, f"receive ({place})")
                arrival, staging = forward_recv_target[k]
                if verify:  # before anything is unpacked from staging
                    counts["num_verified_boxes"] += arrival.check(tensors, staging, f"rank {self.rank} {place}")
                if arrival.io is not None:
                    arrival.io.unpack(tensors, staging, False, f"rank {self.rank} {place}")
                forward_recv_work[k] = []
            for k, (forward, _, place) in enumerate(forward_sends):
                for work in forward_send_work[k]:  # the bytes' staging is reused by batch i + 1
                    transport.wait(work, forward.peer, f"send ({place})")
                forward_send_work[k] = []
        for j, (msg, place) in enumerate(sends):
            for slot in (0, 1):
                if send_work[j][slot] is not None:
                    transport.wait(send_work[j][slot], msg.peer, f"send ({place})")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def _aligned64(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def _dense_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(torch.empty(shape, device="meta").stride())


def _all_lead(nd: int) -> tuple[slice, ...]:
    """Every index of a box's leading dims (all but the last two)."""
    return (slice(None),) * (nd - 2)


def _have_triton() -> bool:
    from elastic_refit.kernels import _triton_backend

    return _triton_backend.HAVE_TRITON


def _windows(steps: tuple[Step, ...], concurrent_rounds: int) -> tuple[tuple[Step, ...], ...]:
    """This rank's steps cut into the plan's windows: ``concurrent_rounds`` consecutive rounds
    of one phase (numbered alike on every rank, so every rank opens the same windows)."""
    windows: dict[tuple[int, int], list[Step]] = {}
    for step in steps:
        windows.setdefault((int(step.phase), step.round // concurrent_rounds), []).append(step)
    return tuple(tuple(w) for _, w in sorted(windows.items()))


class _SourceQuantizer:
    """A sender's side of a quantized plan: the source pieces this rank sends from (element or
    scale rows), quantized into FP8 and scale staging kept for the epoch, after the plan's
    partial-amax exchange (``elastic_refit.plan.quantized``). ``run`` maps the caller's BF16
    source buffers to the buffers ``plan.source`` declares (FP8 and scales)."""

    def __init__(self, plan: Plan, rank: int, device: torch.device, backend: str = "auto") -> None:
        q = plan.quantization
        src = plan.source
        self.rank, self.device, self.q = rank, device, q
        t = plan.transfers
        rows = np.flatnonzero((t.src_rank == rank) & (t.src_side == int(SourceSide.SOURCE)))
        sending = set(plan.expand(rows).src_piece.tolist()) if rows.size else set()
        quantized = {src.tensor_index(n): q.format_of(n) for n in q.scale_tensor if n in src._tensor_index}
        scale_ids = {src.tensor_index(q.scale_tensor[src.tensors[tid].name]) for tid in quantized}
        mine = np.flatnonzero(src.piece_rank == rank)
        # A scale piece by its tensor, buffer and block box: tensors fused in one buffer (q, k
        # and v; gate and up) share a scale buffer, and equal shapes give equal block boxes.
        scale_piece = {}
        for p in mine.tolist():
            if int(src.piece_tensor[p]) in scale_ids:
                nd = len(src.tensors[int(src.piece_tensor[p])].shape)
                scale_piece[(int(src.piece_tensor[p]), self._buffer(src, p), tuple(src.piece_offsets[p, :nd].tolist()),
                             tuple(src.piece_lengths[p, :nd].tolist()))] = p
        self.work = []  # (piece, fmt, name, (buffer, local slices, lengths), scale piece's | None, block offsets)
        self.buffers: dict[str, tuple[str, tuple[int, ...], torch.dtype]] = {}
        for p in mine.tolist():
            tid = int(src.piece_tensor[p])
            fmt = quantized.get(tid)
            if fmt is None:
                continue
            nd = len(src.tensors[tid].shape)
            b_off, b_len = fmt.block_box(src.piece_offsets[p, :nd].tolist(), src.piece_lengths[p, :nd].tolist())
            name = self._buffer(src, p)
            s_piece = scale_piece.get((src.tensor_index(q.scale_tensor[src.tensors[tid].name]), name + fmt.scale_suffix,
                                       b_off, b_len))
            b = int(src.piece_buffer[p])
            self.buffers[name] = (q.logical_source.tensor(src.tensors[tid].name).dtype,
                                  tuple(int(v) for v in src.buffer_shape[b, : int(src.buffer_ndim[b])]),
                                  torch.float8_e4m3fn)
            if s_piece is not None:
                sb = int(src.piece_buffer[s_piece])
                self.buffers[name + fmt.scale_suffix] = (
                    "", tuple(int(v) for v in src.buffer_shape[sb, : int(src.buffer_ndim[sb])]),
                    getattr(torch, fmt.scale_dtype))
            if p not in sending and s_piece not in sending:
                continue
            self.work.append((p, fmt, src.tensors[tid].name, self._local(src, p, nd),
                              None if s_piece is None else self._local(src, s_piece, nd), b_off))
        amax = q.amax
        self.sends = [i for i in range(len(amax)) if amax.provider[i] == rank and amax.kind[i] != 0]
        self.recvs = [i for i in range(len(amax)) if amax.consumer[i] == rank and amax.kind[i] != 0]
        self.by_consumer: dict[int, list[int]] = {}
        for i in range(len(amax)):
            if amax.consumer[i] == rank:
                self.by_consumer.setdefault(int(amax.consumer_piece[i]), []).append(i)
        self.src = src
        # One arena holds every staging buffer (64-byte aligned), so the fused kernel writes
        # FP8 bytes and scales straight into them: they are views of its one bucket.
        self._arena_offset: dict[str, int] = {}
        self.arena_bytes = 0
        for name, (_dtype, shape, stage_dtype) in self.buffers.items():
            self._arena_offset[name] = self.arena_bytes
            self.arena_bytes += _aligned64(int(np.prod(shape)) * stage_dtype.itemsize)
        self._arena: torch.Tensor | None = None
        self._staging: dict[str, torch.Tensor] = {}
        # Per work item: the parts of its block grid the torch path quantizes (block slices of
        # the last two dims; the split blocks at its edges, or all of it), and the programs
        # of the fused kernel for the whole blocks inside (one per format, over the arena).
        self.grids = [self._grid(w[0]) for w in self.work]
        self.parts, self.programs = self._partition(backend)

    @property
    def num_fused_regions(self) -> int:
        """Boxes of whole blocks the fused kernel quantizes per run."""
        return sum(len(program.regions) for program, _ in self.programs)

    def _partition(self, backend: str) -> tuple[list[tuple[tuple[slice, slice], ...]],
                                                 tuple[tuple[QuantPackProgram, tuple[str, ...]], ...]]:
        """Cut every work item into the torch path's parts and the fused kernel's box: with
        the fused kernel (``backend`` "triton", or "auto" on CUDA with Triton), the blocks
        of a piece of a BF16 buffer that lie whole inside it go to one region of the
        format's program, writing strided into the staging; its edge blocks that other
        shards share (split blocks) stay parts, quantized after the exchange."""
        use_kernel = backend == "triton" or (backend == "auto" and self.device.type == "cuda" and _have_triton())
        by_format: dict[str, tuple[object, list[str], list[QuantRegion]]] = {}
        parts: list[tuple[tuple[slice, slice], ...]] = []
        for (p, fmt, _name, (buffer, slices, lengths), scale_at, _b_off), grid in zip(self.work, self.grids, strict=True):
            nd = len(lengths)
            whole = (slice(0, grid[-2]), slice(0, grid[-1]))
            inner = self._whole_blocks(p) if use_kernel and scale_at is not None else None
            if inner is not None and self.buffers[buffer][0] == "bfloat16" \
                    and tuple(sl.stop - sl.start for sl in scale_at[1])[-2:] == grid[-2:]:
                (a, b), (c, d) = inner
                parts.append(tuple(part for part in (
                    (slice(0, a), whole[1]), (slice(b, grid[-2]), whole[1]),
                    (slice(a, b), slice(0, c)), (slice(a, b), slice(d, grid[-1])),
                ) if part[0].stop > part[0].start and part[1].stop > part[1].start))
                rows_cols, _ = self._elements(p, (*_all_lead(nd), slice(a, b), slice(c, d)))
                offsets = (*(sl.start for sl in slices[:-2]), *(sl.start + e.start for sl, e in zip(slices[-2:], rows_cols[-2:], strict=True)))
                box = (*(sl.stop - sl.start for sl in slices[:-2]), *(e.stop - e.start for e in rows_cols[-2:]))
                s_buffer, s_slices, _ = scale_at
                s_offsets = (*(sl.start for sl in s_slices[:-2]), s_slices[-2].start + a, s_slices[-1].start + c)
                d_str, s_str = _dense_strides(self.buffers[buffer][1]), _dense_strides(self.buffers[s_buffer][1])
                _, names, regions = by_format.setdefault(fmt.name, (fmt, [], []))
                if buffer not in names:
                    names.append(buffer)
                itemsize = getattr(torch, fmt.scale_dtype).itemsize
                regions.append(QuantRegion(
                    names.index(buffer), offsets, box,
                    self._arena_offset[buffer] + sum(o * st for o, st in zip(offsets, d_str, strict=True)),
                    self._arena_offset[s_buffer] + itemsize * sum(o * st for o, st in zip(s_offsets, s_str, strict=True)),
                    data_strides=d_str, scale_strides=s_str))
            else:
                parts.append((whole,))
        programs = tuple(
            (QuantPackProgram([self.buffers[n][1] for n in names], regions, fmt, device=self.device, backend="triton",
                              names=names), tuple(names))
            for fmt, names, regions in by_format.values())
        return parts, programs

    def _grid(self, p: int) -> tuple[int, ...]:
        """Piece ``p``'s block grid (lead dims in elements)."""
        src = self.src
        tid = int(src.piece_tensor[p])
        nd = len(src.tensors[tid].shape)
        fmt = self.q.format_of(src.tensors[tid].name)
        return tuple(fmt.block_box(src.piece_offsets[p, :nd].tolist(), src.piece_lengths[p, :nd].tolist())[1])

    def _whole_blocks(self, p: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """Block rows and columns ``[a, b) x [c, d)`` of piece ``p``'s grid that lie whole in
        it (clipped only by the tensor's edge), or None when there are none."""
        src = self.src
        tid = int(src.piece_tensor[p])
        shape = src.tensors[tid].shape
        nd = len(shape)
        fmt = self.q.format_of(src.tensors[tid].name)
        grid = self._grid(p)
        out = []
        for k, b in zip((nd - 2, nd - 1), fmt.block_shape, strict=True):
            lo, n = int(src.piece_offsets[p, k]), int(src.piece_lengths[p, k])
            first = 1 if lo % b else 0
            last = grid[k] - (1 if (lo + n) % b and lo + n != shape[k] else 0)
            if last <= first:
                return None
            out.append((first, last))
        return out[0], out[1]

    def _elements(self, p: int, at: tuple[slice, ...]) -> tuple[tuple[slice, ...], tuple[int, int]]:
        """The element slices of piece ``p`` (its own coordinates) inside the blocks ``at``
        of its grid (lead dims in elements, ``slice(None)``: all), and where they start
        inside their first block."""
        src = self.src
        tid = int(src.piece_tensor[p])
        nd = len(src.tensors[tid].shape)
        fmt = self.q.format_of(src.tensors[tid].name)
        out, origin = list(at[:-2]), []
        for k, b, blocks in zip((nd - 2, nd - 1), fmt.block_shape, at[-2:], strict=True):
            lo, n = int(src.piece_offsets[p, k]), int(src.piece_lengths[p, k])
            first = lo // b
            start, stop = max(lo, (first + blocks.start) * b), min(lo + n, (first + blocks.stop) * b)
            out.append(slice(start - lo, stop - lo))
            origin.append(start % b)
        return tuple(out), (origin[0], origin[1])

    def _amax(self, source, p: int, at: tuple[slice, ...]) -> torch.Tensor:
        """Block amax of piece ``p``'s elements inside the blocks ``at`` of its grid."""
        from elastic_refit.kernels.quantize import block_amax

        elements, origin = self._elements(p, at)
        return block_amax(self._piece(source, p)[elements], self.q.format_of(self._name(p)), origin)

    def _name(self, p: int) -> str:
        return self.src.tensors[int(self.src.piece_tensor[p])].name

    @staticmethod
    def _buffer(layout, p: int) -> str:
        return layout.buffer_names[int(layout.buffer_name[int(layout.piece_buffer[p])])]

    @staticmethod
    def _local(layout, p: int, nd: int) -> tuple[str, tuple[slice, ...], tuple[int, ...]]:
        """(buffer, local slices, global lengths) of piece ``p``."""
        bnd = int(layout.buffer_ndim[int(layout.piece_buffer[p])])
        off, ln = layout.piece_local_offsets[p, :bnd], layout.piece_local_lengths[p, :bnd]
        return (_SourceQuantizer._buffer(layout, p), tuple(slice(int(o), int(o + n)) for o, n in zip(off, ln, strict=True)),
                tuple(int(v) for v in layout.piece_lengths[p, :nd]))

    def _piece(self, source: Mapping[str, torch.Tensor], p: int) -> torch.Tensor:
        nd = len(self.src.tensors[int(self.src.piece_tensor[p])].shape)
        name, slices, lengths = self._local(self.src, p, nd)
        if name not in source:
            raise ValueError(f"rank {self.rank}: source buffer {name!r} is missing")
        return source[name][slices].reshape(lengths)

    def _exchange_slices(self, i: int, p: int) -> tuple[slice, ...]:
        """Where exchange row ``i``'s blocks sit in piece ``p``'s block grid."""
        src, amax = self.src, self.q.amax
        tid = int(src.piece_tensor[p])
        fmt = self.q.format_of(src.tensors[tid].name)
        nd = len(src.tensors[tid].shape)
        b_off, _ = fmt.block_box(src.piece_offsets[p, :nd].tolist(), src.piece_lengths[p, :nd].tolist())
        lo, ln = amax.block_offsets[i, :nd], amax.block_lengths[i, :nd]
        return tuple(slice(int(a - b), int(a - b + n)) for a, b, n in zip(lo, b_off, ln, strict=True))

    def _partial(self, source, i: int, p: int) -> torch.Tensor:
        """The partial amax of piece ``p`` over exchange row ``i``'s blocks."""
        return self._amax(source, p, self._exchange_slices(i, p)).contiguous()

    def run(self, source: Mapping[str, torch.Tensor], transport: Transport) -> dict[str, torch.Tensor]:
        from elastic_refit.kernels.quantize import (
            check_scales,
            combine_amax,
            poisoned,
            quantize_with_scales,
            scales_from_amax,
        )

        amax = self.q.amax
        out = {n: t for n, t in source.items() if n not in self.buffers}
        if self._arena is None:
            self._arena = torch.zeros(self.arena_bytes, dtype=torch.uint8, device=self.device)
        for name, (dtype, shape, stage_dtype) in self.buffers.items():
            if dtype and name in source and (source[name].dtype != getattr(torch, dtype) or tuple(source[name].shape) != shape):
                raise ValueError(f"rank {self.rank}: source buffer {name!r} is {list(source[name].shape)} "
                                 f"{source[name].dtype}, the layout says {list(shape)} {dtype}")
            staged = self._staging.get(name)
            if staged is None:
                at = self._arena_offset[name]
                nbytes = int(np.prod(shape)) * stage_dtype.itemsize
                staged = self._staging[name] = self._arena[at : at + nbytes].view(stage_dtype).reshape(shape)
            out[name] = staged
        # The exchange: one batch of small messages, before any piece is quantized.
        received: dict[int, torch.Tensor] = {}
        ops, waits = [], []
        for i in self.sends:
            payload = self._partial(source, i, int(amax.provider_piece[i]))
            ops.append(P2POp("send", payload.view(torch.uint8).reshape(-1), int(amax.consumer[i]), AMAX_TAG + i))
            waits.append((int(amax.consumer[i]), "send partial amax"))
        for i in self.recvs:
            nd = len(self.src.tensors[int(amax.tensor[i])].shape)
            buf = torch.empty(tuple(int(v) for v in amax.block_lengths[i, :nd]), dtype=torch.float32, device=self.device)
            received[i] = buf
            ops.append(P2POp("recv", buf.view(torch.uint8).reshape(-1), int(amax.provider[i]), AMAX_TAG + i))
            waits.append((int(amax.provider[i]), "receive partial amax"))
        if ops:
            for work, (peer, what) in zip(transport.post(ops), waits, strict=True):
                transport.wait(work, peer, what)
        for program, names in self.programs:  # whole blocks: one launch per group, into the arena
            missing = [n for n in names if n not in source]
            if missing:
                raise ValueError(f"rank {self.rank}: source buffer {missing[0]!r} is missing")
            program.pack([source[n].contiguous() for n in names], self._arena)
        for (p, fmt, name, (buffer, slices, lengths), scale_at, b_off), parts in zip(self.work, self.parts, strict=True):
            if not parts:  # all of it in the fused kernel
                continue
            x = self._piece(source, p)
            lead = _all_lead(len(lengths))
            for rows, cols in parts:
                at = (*lead, rows, cols)
                blocks = self._amax(source, p, at)
                full = (*(slice(0, n) for n in lengths[:-2]), rows, cols)  # the part in the piece's grid
                for i in self.by_consumer.get(p, []):
                    # The row's blocks that fall in this part, in both grids.
                    ex = self._exchange_slices(i, p)
                    lo = [max(f.start, e.start) for f, e in zip(full, ex, strict=True)]
                    hi = [min(f.stop, e.stop) for f, e in zip(full, ex, strict=True)]
                    if any(h <= low for low, h in zip(lo, hi, strict=True)):
                        continue
                    mine = tuple(slice(low - f.start, h - f.start) for low, h, f in zip(lo, hi, full, strict=True))
                    theirs = tuple(slice(low - e.start, h - e.start) for low, h, e in zip(lo, hi, ex, strict=True))
                    partial = received[i] if i in received else self._partial(source, i, int(amax.provider_piece[i]))
                    blocks[mine] = combine_amax(blocks[mine], partial[theirs])
                scales = scales_from_amax(blocks, fmt)
                elements, origin = self._elements(p, at)
                if scale_at is None:  # nothing stages these scales: check them here
                    check_scales(scales, fmt, name, tuple(o + s.start for o, s in zip(b_off, full, strict=True)))
                region = out[buffer][slices][(..., *elements[-2:])]
                region.copy_(quantize_with_scales(x[elements], scales, fmt, origin).reshape(region.shape))
                if scale_at is not None:
                    s_buffer, s_slices, _ = scale_at
                    region = out[s_buffer][s_slices][..., rows, cols]
                    region.copy_(scales.reshape(region.shape))
        # Every staged piece's scales, as the torch path always checked them (the first
        # poisoned block of the first poisoned piece in ``work`` is named, whichever path
        # wrote it); one sync when none is.
        staged = [(w, out[w[4][0]][w[4][1]].reshape(grid)) for w, grid in zip(self.work, self.grids, strict=True)
                  if w[4] is not None]
        if staged and bool(torch.stack([poisoned(v, w[1]).any() for w, v in staged]).any()):
            for (_p, fmt, name, _local, _scale_at, b_off), v in staged:
                check_scales(v, fmt, name, b_off)
        return out
