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
from dataclasses import dataclass

import structlog
import torch

from elastic_refit.errors import TransferRefused, VerificationFailed, brief
from elastic_refit.kernels import BoxRegion, PackProgram
from elastic_refit.layout import DTYPE_ITEMSIZE
from elastic_refit.log import ensure_configured
from elastic_refit.plan import Plan
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


def _windows(steps: tuple[Step, ...], concurrent_rounds: int) -> tuple[tuple[Step, ...], ...]:
    """This rank's steps cut into the plan's windows: ``concurrent_rounds`` consecutive rounds
    of one phase (numbered alike on every rank, so every rank opens the same windows)."""
    windows: dict[tuple[int, int], list[Step]] = {}
    for step in steps:
        windows.setdefault((int(step.phase), step.round // concurrent_rounds), []).append(step)
    return tuple(tuple(w) for _, w in sorted(windows.items()))
