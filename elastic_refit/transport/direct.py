"""Direct reads: a destination copies its regions straight out of a same-host source's memory.

Between ranks whose transport can map each other's memory (CUDA IPC, see
:mod:`elastic_refit.transport.ipc`), an intra-domain message needs no pack, send, receive and
unpack: the destination knows from the plan where every box of the message sits in the
source's buffers (it derives the source's schedule, as the source does) and copies it once.

Which copies (pure, :func:`plan_direct_copies`): the boxes of a bucket pair up by their place
in the packed stream. A pair whose destination box is one contiguous span is *gathered*
(source box -> that span); else one whose source box is contiguous is *scattered* (span ->
destination box); a pair with both strided, or a bucket whose boxes do not pair, goes
through staging (two copies), in groups within the staging budget. Each kind is one kernel
launch for every peer at once (:class:`~elastic_refit.transport.span_copy.SpanCopy`).

Order (:class:`DirectReads`): a source registers the buffers it is read from (the
transport shares their handles through the epoch's store, once per set of addresses),
finishes its pending writes, then signals each of its readers with its registration's
generation; a reader maps what it was told, copies, and finishes its copies before the
executor's closing vote, which every source waits for: no source changes or frees what is
read before the readers are done, and a source that died before its signal fails the read.
Deliveries are read before the network exchange, fan-outs (bytes the source itself received
over the network in this refit) after it, each stage behind its own signal. The transport is
told when copies were queued (``fence_reads``), so that releasing its mappings waits for
those copies and nothing else (never the whole device: a collective stuck on a dead peer
would hold that wait for good).

Which messages are direct (:func:`split_direct`, decided alike on both sides): intra-domain
messages whose peer is in the transport's ``direct_peers``. Network messages and the
forwards of relayed plans go through the transport as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from elastic_refit.layout import DTYPE_ITEMSIZE, Buffer
from elastic_refit.plan import Phase, Plan, TransferKind
from elastic_refit.transport.bucket_io import contiguous_span
from elastic_refit.transport.options import ExecutorOptions
from elastic_refit.transport.protocol import P2POp, Transport
from elastic_refit.transport.schedule import (
    Bucket,
    BufferRef,
    Message,
    RankSchedule,
    build_rank_schedule,
)
from elastic_refit.transport.span_copy import SpanCopy, SpanItem

__all__ = ["DIRECT_TAG", "DirectCopies", "DirectReads", "DirectSplit", "plan_direct_copies", "split_direct"]

DIRECT_TAG = 1 << 21  # the readiness signals; apart from bucket and forward tags
SourceKey = tuple[int, BufferRef]  # (peer, the peer's buffer)


@dataclass(frozen=True, slots=True)
class DirectSplit:
    """A rank's schedule less its direct messages (``schedule``), and those messages with
    the (phase, round) of their step."""

    schedule: RankSchedule
    sends: tuple[tuple[int, int, Message], ...]
    recvs: tuple[tuple[int, int, Message], ...]


def is_direct(msg: Message | None, direct_peers: frozenset[int]) -> bool:
    """Whether ``msg`` moves by a direct read (the same answer on both of its ends)."""
    return msg is not None and msg.kind == TransferKind.INTRA and msg.peer in direct_peers


def split_direct(schedule: RankSchedule, direct_peers: frozenset[int]) -> DirectSplit:
    """Take the direct messages out of ``schedule``'s steps (steps left empty go)."""
    steps, sends, recvs = [], [], []
    for s in schedule.steps:
        send, recv = s.send, s.recv
        if is_direct(send, direct_peers):
            sends.append((int(s.phase), s.round, send))
            send = None
        if is_direct(recv, direct_peers):
            recvs.append((int(s.phase), s.round, recv))
            recv = None
        if send is not None or recv is not None or s.forward_sends or s.forward_recvs:
            steps.append(dataclasses.replace(s, send=send, recv=recv))
    return DirectSplit(dataclasses.replace(schedule, steps=tuple(steps)), tuple(sends), tuple(recvs))


@dataclass(frozen=True, slots=True)
class DirectCopies:
    """A reader's copies for one plan: ``sources`` (mapped peer buffers) and ``targets``
    (its own buffers) by index; ``gather`` items box of a source -> span of a target,
    ``scatter`` items box of a target <- span of a source; ``staged`` groups of (gather
    from sources into staging, scatter from staging into targets, staging bytes)."""

    sources: tuple[SourceKey, ...]
    targets: tuple[BufferRef, ...]
    gather: tuple[SpanItem, ...]
    scatter: tuple[SpanItem, ...]
    staged: tuple[tuple[tuple[SpanItem, ...], tuple[SpanItem, ...], int], ...]
    nbytes: int

    @property
    def staged_bytes(self) -> int:
        return sum(n for _, _, n in self.staged)


def _span(buffers: Mapping[BufferRef, Buffer], box) -> int | None:
    spec = buffers[box.buffer]
    span = contiguous_span(spec.shape, box, DTYPE_ITEMSIZE[spec.dtype])
    return None if span is None else span[0]


def _pairs(recv: Bucket, send: Bucket):
    """The bucket's boxes paired by packed place (None when they do not pair one to one)."""
    by_offset = {(b.packed_offset, b.nbytes): b for b in send.boxes}
    if len(by_offset) != len(recv.boxes) or len(send.boxes) != len(recv.boxes):
        return None
    out = []
    for b in recv.boxes:
        s = by_offset.get((b.packed_offset, b.nbytes))
        if s is None:
            return None
        out.append((s, b))
    return out


def plan_direct_copies(recvs: tuple[tuple[int, int, Message], ...], me: int, senders: Mapping[int, RankSchedule],
                       mine: RankSchedule, staging_bytes: int) -> DirectCopies:
    """Rank ``me``'s copies for its direct messages ``recvs``; ``senders``: each source
    peer's schedule (its boxes of each message), ``mine`` this rank's."""
    sources: dict[SourceKey, int] = {}
    targets: dict[BufferRef, int] = {}
    gather: list[SpanItem] = []
    scatter: list[SpanItem] = []
    units: list[tuple[list, list, int]] = []  # (pairs of (send box, recv box, offset in unit)), bytes

    def src(peer: int, ref: BufferRef) -> int:
        return sources.setdefault((peer, ref), len(sources))

    def dst(ref: BufferRef) -> int:
        return targets.setdefault(ref, len(targets))

    for phase, round_, msg in recvs:
        sent = _sent_message(senders[msg.peer], me, phase, round_)
        for rb, sb in zip(msg.buckets, sent.buckets, strict=True):
            pairs = _pairs(rb, sb)
            if pairs is None:  # the whole bucket through staging, in its packed order
                units.append(([(msg.peer, s, s.packed_offset) for s in sb.boxes],
                              [(r, r.packed_offset) for r in rb.boxes], rb.nbytes))
                continue
            for s, r in pairs:
                d_off = _span(mine.buffers, r)
                if d_off is not None:
                    gather.append(SpanItem(src(msg.peer, s.buffer), s.offsets, s.lengths, dst(r.buffer), d_off))
                    continue
                s_off = _span(senders[msg.peer].buffers, s)
                if s_off is not None:
                    scatter.append(SpanItem(dst(r.buffer), r.offsets, r.lengths, src(msg.peer, s.buffer), s_off))
                else:
                    units.append(([(msg.peer, s, 0)], [(r, 0)], r.nbytes))
    staged = []
    group: tuple[list, list, int] = ([], [], 0)
    for sends, recvs_, nbytes in units:
        if nbytes > staging_bytes:
            raise ValueError(f"rank {me}: a direct copy of {nbytes} bytes needs staging above the budget of "
                             f"{staging_bytes}")
        if group[2] + nbytes > staging_bytes:
            staged.append((tuple(group[0]), tuple(group[1]), group[2]))
            group = ([], [], 0)
        base = -(-group[2] // 16) * 16  # 16-byte aligned units keep wide accesses
        group[0].extend(SpanItem(src(p, s.buffer), s.offsets, s.lengths, 0, base + off) for p, s, off in sends)
        group[1].extend(SpanItem(dst(r.buffer), r.offsets, r.lengths, 0, base + off) for r, off in recvs_)
        group = (group[0], group[1], base + nbytes)
    if group[2]:
        staged.append((tuple(group[0]), tuple(group[1]), group[2]))
    return DirectCopies(tuple(sources), tuple(targets), tuple(gather), tuple(scatter), tuple(staged),
                        sum(m.nbytes for _, _, m in recvs))


def _sent_message(sender: RankSchedule, me: int, phase: int, round_: int) -> Message:
    """The sender's side of the message ``me`` receives in (``phase``, ``round_``)."""
    for s in sender.steps:
        if int(s.phase) == phase and s.round == round_ and s.send is not None and s.send.peer == me:
            return s.send
    raise ValueError(f"rank {sender.rank}'s schedule sends nothing to rank {me} in phase {phase} round {round_}")


class _Stage:
    """The direct messages of one stage: the readers this rank signals, the sources it reads
    from, and its copies (one launch per kind for every source at once)."""

    def __init__(self, sends, recvs, me: int, senders: Mapping[int, RankSchedule], mine: RankSchedule,
                 device: torch.device, options: ExecutorOptions) -> None:
        self.readers = sorted({m.peer for _, _, m in sends})
        self.sources = sorted({m.peer for _, _, m in recvs})
        self.copies = c = plan_direct_copies(recvs, me, senders, mine, options.staging_bytes)
        self.source_specs = {key: senders[key[0]].buffers[key[1]] for key in c.sources}
        src_shapes = [self.source_specs[k].shape for k in c.sources]
        src_dtypes = [getattr(torch, self.source_specs[k].dtype) for k in c.sources]
        dst_shapes = [mine.buffers[r].shape for r in c.targets]
        dst_dtypes = [getattr(torch, mine.buffers[r].dtype) for r in c.targets]
        backend = options.pack_backend

        def prog(shapes, dtypes, items, gather):
            return SpanCopy(shapes, dtypes, items, gather=gather, device=device, backend=backend)

        self.gather = prog(src_shapes, src_dtypes, c.gather, True)
        self.scatter = prog(dst_shapes, dst_dtypes, c.scatter, False)
        self.staged = [(prog(src_shapes, src_dtypes, g, True), prog(dst_shapes, dst_dtypes, s, False), n)
                       for g, s, n in c.staged]

    @property
    def empty(self) -> bool:
        return not self.readers and not self.sources


class DirectReads:
    """One rank's direct messages of a plan over a transport with ``direct_peers`` (and
    ``share`` / ``peer_buffers``, see :class:`~elastic_refit.transport.ipc.IpcTransport`):
    built once per (plan, epoch); every refit calls :meth:`run` before the network
    exchange and :meth:`run_fan_out` after it.

    Two stages, because a fan-out's source holds its bytes only once the network phase
    delivered them to it: the deliveries (phase ``DELIVER``: source pieces, final when the
    refit starts) are read first, the fan-outs (phase ``FAN_OUT``: what the source rank
    received in this refit) once every rank's network exchange is done, each stage after
    its own signal from the source. Read earlier, a fan-out copied what the buffers held
    before the refit."""

    def __init__(self, plan: Plan, schedule: RankSchedule, transport: Transport, options: ExecutorOptions) -> None:
        self.transport = transport
        self.device = transport.device
        self.rank = transport.rank
        split = split_direct(schedule, frozenset(transport.direct_peers))  # type: ignore[attr-defined]
        self.network_schedule = split.schedule
        self.exported = sorted({b.buffer for _, _, m in split.sends for bk in m.buckets for b in bk.boxes})
        senders = {p: build_rank_schedule(plan, p) for p in sorted({m.peer for _, _, m in split.recvs})}
        fan_out = int(Phase.FAN_OUT)

        def stage(later: bool) -> _Stage:
            sends = tuple(x for x in split.sends if (x[0] >= fan_out) == later)
            recvs = tuple(x for x in split.recvs if (x[0] >= fan_out) == later)
            return _Stage(sends, recvs, self.rank, senders, schedule, self.device, options)

        self.stages = (stage(False), stage(True))
        self.readers = sorted(set().union(*(s.readers for s in self.stages)))
        self.sources = sorted(senders)
        self._gen = 0
        staged = [n for s in self.stages for _, _, n in s.staged]
        self._staging_bytes = max(staged, default=0)
        self._staging: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes this rank reads directly per refit."""
        return sum(s.copies.nbytes for s in self.stages)

    def run(self, tensors: Mapping[BufferRef, torch.Tensor]) -> int:
        """The first stage: share this rank's read buffers (all of them, for both stages),
        signal its readers of deliveries, read its deliveries; the copies are queued on the
        current stream. Returns the bytes read."""
        t = self.transport
        self._gen = t.share({ref: tensors[ref] for ref in self.exported}) if self.exported else 0  # type: ignore[attr-defined]
        return self._run_stage(self.stages[0], tensors)

    def run_fan_out(self, tensors: Mapping[BufferRef, torch.Tensor]) -> int:
        """The second stage, once this rank's network exchange is done (what it received is
        in its buffers): signal its fan-out readers, read its fan-outs."""
        return self._run_stage(self.stages[1], tensors)

    def _run_stage(self, stage: _Stage, tensors: Mapping[BufferRef, torch.Tensor]) -> int:
        if stage.empty:
            return 0
        t = self.transport
        if stage.readers and self.device.type == "cuda":
            # What readers read is final before they are told: the executor's writes (local
            # copies, the network phase's unpacks) are on the current stream. Not the whole
            # device: a parked communicator's collective stuck on a dead peer never ends.
            torch.cuda.current_stream(self.device).synchronize()
        mine = torch.tensor([self._gen], dtype=torch.int64, device=self.device)
        theirs = torch.zeros(len(stage.sources), dtype=torch.int64, device=self.device)
        ops = [P2POp("send", mine, p, DIRECT_TAG) for p in stage.readers]
        ops += [P2POp("recv", theirs[i : i + 1], p, DIRECT_TAG) for i, p in enumerate(stage.sources)]
        for op, work in zip(ops, t.post(ops), strict=True):
            t.wait(work, op.peer, f"direct-read signal {'to' if op.op == 'send' else 'from'} rank {op.peer}")
        if not stage.sources:
            return 0
        gens = dict(zip(stage.sources, theirs.tolist(), strict=True))
        mapped: dict[SourceKey, torch.Tensor] = {}
        for p in stage.sources:
            specs = {ref: spec for (peer, ref), spec in stage.source_specs.items() if peer == p}
            views = t.peer_buffers(p, gens[p], specs)  # type: ignore[attr-defined]
            mapped.update({(p, ref): v for ref, v in views.items()})
        try:
            self._copy(stage, [mapped[k] for k in stage.copies.sources],
                       [tensors[r] for r in stage.copies.targets])
        finally:
            # Whatever was queued reads mapped memory: nothing is unmapped before it is done.
            fence = getattr(t, "fence_reads", None)
            if fence is not None:
                fence()
        moved = getattr(t, "moved", None)
        if moved is not None:
            moved["direct"] += stage.copies.nbytes
        return stage.copies.nbytes

    def _copy(self, stage: _Stage, src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
        stage.gather.run(src, dst)
        stage.scatter.run(dst, src)
        if stage.staged:
            if self._staging is None:
                self._staging = torch.empty(self._staging_bytes, dtype=torch.uint8, device=self.device)
            for gather, scatter, _ in stage.staged:
                gather.run(src, [self._staging])
                scatter.run(dst, [self._staging])
