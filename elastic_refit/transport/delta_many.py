"""Several messages' deltas coded, checked and written at once (``transport.delta``).

On a GPU the work of a delta is not its elements (a few percent of the bytes: microseconds
of device time) but its operations: a few hundred small kernels and a few read-backs per
call of :meth:`Boxes.segments` or :meth:`Boxes.apply_segments`, each waiting its turn on a
device that other processes share. So a sender codes every message of a sizes batch in one
call, over the boxes of all of them (:class:`Together`), and a receiver checks and writes
every message it received in one call once the exchange is over. The boxes of different
messages never overlap (each destination element comes from one source), so one geometry
over all of them is the same change, box by box, as one per message.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

import torch

from elastic_refit.transport.delta_boxes import Boxes, Segments
from elastic_refit.transport.schedule import BoxCopy, RankSchedule

__all__ = ["Together", "join_segments", "split_segments"]


class Together:
    """The :class:`Boxes` over several messages' boxes, by the messages' indices (a refit
    codes or writes a few sets of messages, the same from refit to refit: kept, the least
    recently used dropped past ``limit``)."""

    def __init__(self, boxes_of: Sequence[tuple[BoxCopy, ...]], schedule: RankSchedule, device: torch.device, *,
                 limit: int = 8) -> None:
        self._boxes_of = boxes_of
        self._schedule = schedule
        self._device = device
        self._limit = limit
        self._kept: OrderedDict[tuple[int, ...], Boxes] = OrderedDict()

    def of(self, indices: Sequence[int]) -> Boxes:
        """The boxes of messages ``indices``, message after message."""
        key = tuple(indices)
        boxes = self._kept.get(key)
        if boxes is None:
            boxes = Boxes(tuple(b for i in key for b in self._boxes_of[i]), self._schedule, self._device)
            self._kept[key] = boxes
            if len(self._kept) > self._limit:
                self._kept.popitem(last=False)
        self._kept.move_to_end(key)
        return boxes

    def counts(self, indices: Sequence[int]) -> list[int]:
        """Boxes per message of ``indices``."""
        return [len(self._boxes_of[i]) for i in indices]


def split_segments(seg: Segments, counts: Sequence[int]) -> list[Segments]:
    """``seg`` (boxes of several messages, ``counts[k]`` boxes of the k-th) cut per message;
    each message's coded bytes are a view of ``seg``'s."""
    lengths = (seg.entries + seg.value_bytes).tolist()  # host sizes
    out, box, at = [], 0, 0
    for n in counts:
        nbytes = sum(lengths[box : box + n])
        out.append(Segments(seg.entries[box : box + n], seg.value_bytes[box : box + n], seg.coded[at : at + nbytes],
                            seg.moves[box : box + n]))
        box, at = box + n, at + nbytes
    return out


def join_segments(parts: Sequence[Segments]) -> tuple[Segments, list[int]]:
    """Several messages' segments as one (boxes message after message), and each message's
    first box in it."""
    if len(parts) == 1:
        return parts[0], [0]
    firsts = list(itertools.accumulate([0] + [len(p.entries) for p in parts]))[:-1]
    return Segments(torch.cat([p.entries for p in parts]), torch.cat([p.value_bytes for p in parts]),
                    torch.cat([p.coded for p in parts]), torch.cat([p.moves for p in parts])), firsts
