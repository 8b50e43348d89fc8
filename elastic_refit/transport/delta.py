"""Deltas in the executor: a bucket sent as its change against a base (DESIGN.md, "Deltas").

Routes stay the plan's. Per refit, a sender that holds the base (its source buffers as it
published them for the base version) compares each bucket of a message to a destination
that holds the same base, verified (``DeltaInputs.receivers``, the coordinator's choice), and
sends the change (:mod:`elastic_refit.kernels.delta`) when it is smaller than the bucket.
Sizes are learned before payloads move: one batch, before the first window, carries one
vector of sizes per such message (a bucket's payload size, or :data:`FULL`), so a receiver
posts each bucket with its size. A delta travels in the staging the bucket would have used
(it is never larger), followed, with verification on, by the digests of the bucket's boxes
as published: the receiver packs its base for the bucket from its own buffers into scratch,
applies the change there, checks every box against the sender's digest and then unpacks as
for a full bucket. A receiver whose buffers did not hold the base fails the check: nothing
wrong is unpacked.

Relayed messages (a relay forwards their bytes as they arrived), a plan that quantizes on
the way, and buckets whose bytes come from the destination side (holders, fan-out) always
go in full; so does a bucket whose change is not smaller than itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from elastic_refit.kernels.delta import (
    apply_delta,
    changed_elements,
    delta_unit,
    encode_delta,
    encoded_nbytes,
)
from elastic_refit.layout import DTYPE_ITEMSIZE
from elastic_refit.plan import SourceSide, TransferKind
from elastic_refit.transport.bucket_io import DIGEST_BYTES, BucketIO
from elastic_refit.transport.buffers import digest
from elastic_refit.transport.protocol import P2POp, Transport
from elastic_refit.transport.schedule import STAGED, Message, RankSchedule

__all__ = ["FULL", "SIZES_TAG", "DeltaCoder", "DeltaInputs", "DeltaRound"]

FULL = -1  # a bucket's size entry: it travels in full
SIZES_TAG = 1 << 21  # + the step's (round, phase): apart from buckets' and forwards' tags


@dataclass(frozen=True, slots=True)
class DeltaInputs:
    """What one refit's deltas need on this rank. ``base``: a sender's source buffers (by
    name) as published for the base version (empty: it has none, it sends in full);
    ``receivers``: the communicator ranks that hold the base, verified, and may be sent a
    delta (the same on every rank)."""

    base: Mapping[str, torch.Tensor] = field(default_factory=dict)
    receivers: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "receivers", frozenset(int(r) for r in self.receivers))
        bad = sorted(r for r in self.receivers if r < 0)
        if bad:
            raise ValueError(f"receivers must be ranks >= 0, got {bad}")


class DeltaRound:
    """One refit's deltas on this rank: each delta bucket's payload size (``sizes``, by the
    id of its ``BucketIO``), the payloads encoded while sizing that were kept, and what was
    saved."""

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        self.kept: dict[int, torch.Tensor | None] = {}
        self.num_buckets = 0
        self.saved_bytes = {"network": 0, "intra": 0}

    def size(self, io: BucketIO) -> int | None:
        """The payload size of a delta bucket, None for a full one."""
        return self.sizes.get(id(io))


class DeltaCoder:
    """The delta part of one executor (one plan, one rank): which messages may carry
    deltas, two scratch buffers, and per refit :meth:`prepare` (sizing and the exchange of
    sizes), :meth:`payload` (a sender's bucket) and :meth:`rebuild` (a receiver's)."""

    def __init__(self, schedule: RankSchedule, io: Mapping[int, BucketIO], *, quantized: bool, verify: bool,
                 device: torch.device) -> None:
        self.schedule = schedule
        self._io = io
        self.verify = verify
        self.device = device
        self.rank = schedule.rank
        self.messages = [] if quantized else [
            (step, msg, msg is step.recv) for step in schedule.steps for msg in (step.send, step.recv)
            if msg is not None and eligible(msg)]
        self._scratch: list[torch.Tensor] = []

    @property
    def scratch_bytes(self) -> int:
        return sum(t.numel() for t in self._scratch)

    @staticmethod
    def may_carry(msg: Message) -> bool:
        return eligible(msg)

    def scratch(self, nbytes: int) -> None:
        """Allocate the two scratch buffers (``nbytes`` each, 8-aligned by the caller)."""
        if not self._scratch:
            self._scratch = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(2)]

    # ---- per refit ------------------------------------------------------------------------
    def prepare(self, inputs: DeltaInputs, tensors: Mapping, transport: Transport, keep_bytes: int) -> DeltaRound:
        """Size every bucket this rank sends to a receiver (encoding it; payloads are kept
        while they fit ``keep_bytes``), then exchange the sizes of every message that may
        carry deltas, in one batch. Returns the refit's round."""
        rnd = DeltaRound()
        if not inputs.receivers or not self.messages:
            return rnd
        base = self._base_tensors(inputs.base)
        ops, received = [], []
        for step, msg, receiving in self.messages:
            tag = SIZES_TAG + (step.round << 2) + int(step.phase)
            if receiving and self.rank in inputs.receivers:
                sizes = torch.empty(len(msg.buckets), dtype=torch.int64, device=self.device)
                ops.append(P2POp("recv", sizes, msg.peer, tag))
                received.append((msg, sizes))
            elif not receiving and msg.peer in inputs.receivers:
                sizes = self._size_message(msg, tensors, base, rnd, keep_bytes)
                ops.append(P2POp("send", sizes.to(self.device), msg.peer, tag))
        if ops:
            for op, work in zip(ops, transport.post(ops), strict=True):
                transport.wait(work, op.peer, f"{op.op} of delta sizes")
        for msg, sizes in received:
            for bucket, size in zip(msg.buckets, sizes.tolist(), strict=True):
                io = self._io[id(bucket)]
                if size != FULL:
                    if not 0 < size < io.wire_bytes:
                        raise ValueError(f"rank {self.rank}: rank {msg.peer} announced a delta of {size} bytes "
                                         f"for a bucket of {io.wire_bytes}")
                    rnd.sizes[id(io)] = int(size)
        return rnd

    def _base_tensors(self, base: Mapping[str, torch.Tensor]) -> dict:
        """The base buffers by this rank's buffer refs (source side), those that match the
        layout (a base in another shape is no base)."""
        out = {}
        for ref, buffer in self.schedule.buffers.items():
            side, name = ref
            t = base.get(name) if side == int(SourceSide.SOURCE) else None
            if (t is not None and tuple(t.shape) == buffer.shape and t.dtype == getattr(torch, buffer.dtype)
                    and t.is_contiguous() and t.device.type == self.device.type):
                out[ref] = t
        return out

    def _size_message(self, msg: Message, tensors: Mapping, base: Mapping, rnd: DeltaRound,
                      keep_bytes: int) -> torch.Tensor:
        sizes = torch.full((len(msg.buckets),), FULL, dtype=torch.int64)
        kept = sum(p.numel() for p in rnd.kept.values() if p is not None)
        for i, bucket in enumerate(msg.buckets):
            io = self._io[id(bucket)]
            if io.program is None or not all(r in base for r in io.refs):
                continue
            n = bucket.nbytes
            current, old = self._scratch[0][:n], self._scratch[1][:n]
            io._bound(tensors, current).pack()
            io._bound(base, old).pack()
            unit = _unit(io, self.schedule)
            changed = changed_elements(current, old, unit)
            size = encoded_nbytes(changed, unit) + self._trailer_bytes(io)
            if size >= io.wire_bytes:
                continue
            sizes[i] = size
            rnd.sizes[id(io)] = size
            rnd.num_buckets += 1
            rnd.saved_bytes["network" if msg.kind == TransferKind.NETWORK else "intra"] += io.wire_bytes - size
            payload = None
            if kept + size <= keep_bytes:
                payload = torch.empty(size, dtype=torch.uint8, device=self.device)
                self._encode(io, current, old, unit, payload, changed)
                kept += size
            rnd.kept[id(io)] = payload
        return sizes

    def _trailer_bytes(self, io: BucketIO) -> int:
        return DIGEST_BYTES * len(io.bucket.boxes) if self.verify else 0

    def _encode(self, io: BucketIO, current: torch.Tensor, old: torch.Tensor, unit: int, out: torch.Tensor,
                changed: torch.Tensor | None = None) -> None:
        """Encode ``current`` against ``old`` into ``out`` (which may be ``current``'s
        staging), the digests of ``current``'s boxes after the change."""
        digests = _box_digests(io, current) if self.verify else None
        coded = encode_delta(current, old, unit, out=out, changed=changed)
        if digests is not None:
            out[coded.numel() : coded.numel() + digests.numel() * DIGEST_BYTES].copy_(digests.view(torch.uint8))

    def payload(self, rnd: DeltaRound, io: BucketIO, tensors: Mapping, staging: torch.Tensor,
                base: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """What a sender sends for a delta bucket (None: the bucket goes in full): the
        payload kept while sizing, copied into ``staging``, or encoded there anew."""
        size = rnd.size(io)
        if size is None:
            return None
        out = staging[:size]
        kept = rnd.kept.get(id(io))
        if kept is not None:
            out.copy_(kept)
            return out
        n = io.bucket.nbytes
        current, old = staging[:n], self._scratch[1][:n]
        io._bound(tensors, current).pack()
        io._bound(self._base_tensors(base), old).pack()
        self._encode(io, current, old, _unit(io, self.schedule), out)
        return out

    def rebuild(self, rnd: DeltaRound, io: BucketIO, tensors: Mapping, payload: torch.Tensor) -> torch.Tensor:
        """A receiver's delta bucket: its base packed from its own buffers into scratch, the
        change applied, the sender's digests after it; returns the bucket as a full one
        arrives (to unpack, checking the digests)."""
        n, trailer = io.bucket.nbytes, self._trailer_bytes(io)
        bucket = self._scratch[0][: io.wire_bytes]
        io._bound(tensors, bucket[:n]).pack()
        apply_delta(payload[: payload.numel() - trailer], bucket[:n], _unit(io, self.schedule))
        if trailer:
            bucket[io.trailer_offset : io.wire_bytes].copy_(payload[payload.numel() - trailer :])
        return bucket


def eligible(msg: Message) -> bool:
    """Whether ``msg`` may carry deltas: not relayed (a relay forwards bytes as they
    arrived) and without boxes staged for others (the same answer on both ends)."""
    return not msg.relayed and not any(b.buffer == STAGED for bucket in msg.buckets for b in bucket.boxes)


def _unit(io: BucketIO, schedule: RankSchedule) -> int:
    return delta_unit(DTYPE_ITEMSIZE[schedule.buffers[ref].dtype] for ref in io.refs)


def _box_digests(io: BucketIO, data: torch.Tensor) -> torch.Tensor:
    return torch.stack([digest(data[b.packed_offset : b.packed_offset + b.nbytes]) for b in io.bucket.boxes])
