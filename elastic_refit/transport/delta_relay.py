"""Deltas in relayed plans (``transport.delta``): a relay's forward parts and a needer's.

The relay receives the network message's payload in staging as it would the bytes, writes
its own boxes' changes, and forwards each needer its boxes' segments straight from there
(the runs the full bytes would take are runs of segments here) and their digest moves; the
needer writes them into its buffers. A needer learns the sizes of its forwards from its
relay, in a second batch after the first (:meth:`RelayedDeltas._exchange_part_sizes`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from elastic_refit.kernels.delta import HEADER_BYTES
from elastic_refit.transport.bucket_io import DIGEST_BYTES, BucketIO, aligned
from elastic_refit.transport.delta_boxes import Segments
from elastic_refit.transport.delta_round import (
    FORWARD_SIZES_TAG,
    FULL,
    DeltaInputs,
    DeltaRound,
    _Bucket,
    _Part,
    exchange,
)
from elastic_refit.transport.protocol import P2POp, Transport
from elastic_refit.transport.schedule import ForwardPart

__all__ = ["RelayedDeltas"]


class RelayedDeltas:
    """The relay's and the needer's side of :class:`~elastic_refit.transport.delta.DeltaCoder`
    (a base class: the coder holds what these read, ``messages``, ``_forward_sends``,
    ``_forward_recvs``, ``_part_boxes``, ``verify``, ``device`` and ``_apply``)."""

    messages: list
    verify: bool
    device: torch.device
    _forward_sends: list
    _forward_recvs: list
    _part_boxes: dict
    _apply: Callable[..., int]
    _relayed_ok: Callable[[int, frozenset[int]], bool]
    rank: int

    def _exchange_part_sizes(self, inputs: DeltaInputs, rnd: DeltaRound, transport: Transport) -> None:
        """A relay's sizes of each forward part it will send as a delta, to its needers; a
        needer's, received: where its delta parts land."""
        ops, received = [], []
        for step, f in self._forward_sends:
            if not self._relayed_ok(self.rank, inputs.receivers):
                continue
            index = next(i for i, (s, _m, r) in enumerate(self.messages) if s is step and r)
            vectors = []
            for part in f.parts:
                b = self._bucket_of(rnd, index, part.bucket)
                m = rnd.messages.get(index)
                boxes = [b.boxes[0] + d for d in part.digests] if b is not None else []
                vectors.append(torch.tensor([FULL] * len(part.digests) * 2, dtype=torch.int64) if b is None or m is None
                               else torch.cat([m.entries[boxes], m.value_bytes[boxes]]))
            ops.append(P2POp("send", torch.cat(vectors).to(self.device), f.peer, _part_tag(step)))
        for step, f in self._forward_recvs:
            if self._relayed_ok(self.rank, inputs.receivers):
                sizes = torch.empty(2 * sum(len(p.boxes.boxes) for p in f.parts), dtype=torch.int64,  # type: ignore[union-attr]
                                    device=self.device)
                ops.append(P2POp("recv", sizes, f.peer, _part_tag(step)))
                received.append((f, sizes))
        exchange(transport, ops, "delta sizes of forwards")
        for f, sizes in received:
            at = 0
            for part in f.parts:
                n = len(part.boxes.boxes)  # type: ignore[union-attr]
                entries, value_bytes = sizes[at : at + n].cpu(), sizes[at + n : at + 2 * n].cpu()
                at += 2 * n
                if n and int(entries[0]) != FULL:
                    rnd.parts[id(part)] = self._landing(part, entries, value_bytes)

    def _bucket_of(self, rnd: DeltaRound, index: int, bucket: int) -> _Bucket | None:
        msg = self.messages[index][1]
        return rnd.coded.get(id(self._io[id(msg.buckets[bucket])]))

    def _landing(self, part: ForwardPart, entries: torch.Tensor, value_bytes: torch.Tensor) -> _Part:
        lengths = (entries + value_bytes).tolist()
        boxes = part.boxes.boxes  # type: ignore[union-attr]
        runs = []
        for offset, nbytes in part.spans:  # the relay sends each run of touching boxes as one
            runs.append(sum(n for b, n in zip(boxes, lengths, strict=True) if offset <= b.packed_offset < offset + nbytes))
        data = sum(lengths)
        size = aligned(data) + DIGEST_BYTES * len(boxes) if self.verify else data
        return _Part(entries, value_bytes, runs, torch.empty(max(size, 1), dtype=torch.uint8, device=self.device))

    def forward(self, rnd: DeltaRound, io: BucketIO, part: ForwardPart, data: torch.Tensor) -> list[torch.Tensor] | None:
        """A relay's delta forward part of the bucket that arrived in ``data`` (None: it
        came in full): per run of touching boxes its segments, then their digest moves."""
        b = rnd.coded.get(id(io))
        if b is None:
            return None
        m = rnd.messages[b.message]
        first, out = b.boxes[0], []
        runs: list[list[int]] = []
        for d in part.digests:
            if runs and runs[-1][-1] == d - 1:
                runs[-1].append(d)
            else:
                runs.append([d])
        base = m.starts[first]
        for run in runs:
            start, last = m.starts[first + run[0]] - base, first + run[-1]
            end = m.starts[last] - base + int(m.entries[last] + m.value_bytes[last])
            out.append(data[HEADER_BYTES + start : HEADER_BYTES + end])
        if self.verify:
            trailer = data[aligned(HEADER_BYTES + b.segments[1] - b.segments[0]) : b.size].view(torch.int64)
            out.append(trailer[list(part.digests)].view(torch.uint8))
        rnd.saved_bytes["intra"] += part.nbytes - sum(t.numel() for t in out)
        return out

    def landing(self, rnd: DeltaRound, part: ForwardPart) -> list[torch.Tensor] | None:
        """Where a needer's delta forward part lands, one tensor per operation the relay
        posts (None: it comes in full)."""
        p = rnd.part(part)
        if p is None:
            return None
        out, at = [], 0
        for n in p.runs:
            out.append(p.buffer[at : at + n])
            at += n
        if self.verify:
            start = aligned(at)
            out.append(p.buffer[start : start + DIGEST_BYTES * len(part.boxes.boxes)])  # type: ignore[union-attr]
        return out

    def apply_part(self, rnd: DeltaRound, part: ForwardPart, tensors: Mapping, where: str) -> int:
        """A needer's delta forward part, arrived: its boxes' changes written (checked first)."""
        p = rnd.parts[id(part)]
        n = len(part.boxes.boxes)  # type: ignore[union-attr]
        data = int((p.entries + p.value_bytes).sum())
        moves = (p.buffer[aligned(data) : aligned(data) + DIGEST_BYTES * n].view(torch.int64) if self.verify
                 else torch.zeros(n, dtype=torch.int64, device=self.device))
        return self._apply(self._part_boxes[id(part)], Segments(p.entries, p.value_bytes, p.buffer[:data], moves),
                           tensors, lambda _box: where)


def _part_tag(step) -> int:
    return FORWARD_SIZES_TAG + (step.round << 2) + int(step.phase)
