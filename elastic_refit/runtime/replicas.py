"""Replica consistency: source ranks that hold the same region of a tensor must hold the
same bytes there.

Data-parallel trainer replicas are supposed to be bit-identical; a parallelism plan that
leaves some replicated parameter's gradients unreduced breaks that silently, and a refit
would then hand each inference rank whichever replica the plan happened to read. Before a
version moves, the coordinator compares the replicas' digests of every shared region
(taken by each trainer at ``publish``) and refuses the version, naming the tensor, the
region and the ranks that disagree.

``replica_regions`` is pure (layout in, frozen regions out); ``region_digests`` only reads
the tensors it is given; ``replica_disagreement`` is pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from elastic_refit.layout import Box, Layout
from elastic_refit.transport.buffers import view_digest

__all__ = ["ReplicaRegion", "region_digests", "replica_disagreement", "replica_regions"]


@dataclass(frozen=True, slots=True)
class ReplicaRegion:
    """Box ``box`` of tensor ``tensor`` is held by every rank of ``ranks`` (two at least,
    sorted); ``index`` is its place in :func:`replica_regions`' answer, the same on every
    process for the same layout."""

    index: int
    tensor: str
    box: Box
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.ranks) < 2 or list(self.ranks) != sorted(set(self.ranks)):
            raise ValueError(f"a replica region needs two or more distinct sorted ranks, got {self.ranks}")


def replica_regions(layout: Layout) -> tuple[ReplicaRegion, ...]:
    """Every region of a tensor that two or more ranks of ``layout`` hold.

    Pieces with the same global box form one region held by all their ranks. Pieces with
    different boxes that overlap (replicas sharded differently) add their intersection,
    held by the lowest rank of each; comparing those representatives, each also checked
    against its own group, covers every pair."""
    regions: list[ReplicaRegion] = []
    for t_index, tensor in enumerate(layout.tensors):
        rows = np.flatnonzero(layout.piece_tensor == t_index)
        nd = len(tensor.shape)
        by_box: dict[Box, set[int]] = {}
        for row in rows:
            box = Box(tuple(int(v) for v in layout.piece_offsets[row, :nd]),
                      tuple(int(v) for v in layout.piece_lengths[row, :nd]))
            by_box.setdefault(box, set()).add(int(layout.piece_rank[row]))
        boxes = sorted(by_box, key=lambda b: (b.offsets, b.lengths))
        for box in boxes:
            if len(by_box[box]) > 1:
                regions.append(ReplicaRegion(len(regions), tensor.name, box, tuple(sorted(by_box[box]))))
        # Distinct boxes of one sharding are disjoint: sweep along the dim that tells the
        # most of them apart, so only boxes overlapping there are intersected.
        if len(boxes) > 1:
            dim = max(range(nd), key=lambda d: len({b.offsets[d] for b in boxes})) if nd else 0
            ordered = sorted(boxes, key=lambda b: (b.offsets[dim] if nd else 0, b.offsets, b.lengths))
            for i, a in enumerate(ordered):
                for b in ordered[i + 1:]:
                    if nd and b.offsets[dim] >= a.ends[dim]:
                        break
                    common = a.intersect(b)
                    rank_a, rank_b = min(by_box[a]), min(by_box[b])
                    if common is not None and rank_a != rank_b:
                        regions.append(ReplicaRegion(len(regions), tensor.name, common,
                                                     tuple(sorted((rank_a, rank_b)))))
    return tuple(regions)


def region_digests(layout: Layout, rank: int, tensors: Mapping[str, torch.Tensor],
                   regions: tuple[ReplicaRegion, ...], known: Mapping[str, int] | None = None) -> dict[int, str]:
    """This rank's digest (hex) of every region it takes part in, by region index; read
    from its buffers ``tensors`` (checked against the layout beforehand). ``known``: the
    buffers' whole digests (``buffer_digests``), reused for a region that is a whole
    buffer (data-parallel replicas), so those bytes are read once."""
    out: dict[int, str] = {}
    mine = [r for r in regions if rank in r.ranks]
    if not mine:
        return out
    rows = np.flatnonzero(layout.piece_rank == rank)
    for region in mine:
        t_index = layout.tensor_index(region.tensor)
        nd = len(region.box.offsets)
        for row in rows:
            if int(layout.piece_tensor[row]) != t_index:
                continue
            piece = Box(tuple(int(v) for v in layout.piece_offsets[row, :nd]),
                        tuple(int(v) for v in layout.piece_lengths[row, :nd]))
            if not piece.contains(region.box):
                continue
            pad = layout.piece_offsets.shape[1] - nd  # layout columns are padded to its widest tensor
            off, length = layout.local_regions(np.array([row]), np.array([region.box.offsets + (0,) * pad]),
                                               np.array([region.box.lengths + (1,) * pad]))
            b = int(layout.piece_buffer[row])
            name = layout.buffer_names[int(layout.buffer_name[b])]
            buffer = tensors[name]
            nd_b = int(layout.buffer_ndim[b])
            local = Box(tuple(int(v) for v in off[0, :nd_b]), tuple(int(v) for v in length[0, :nd_b]))
            whole = local.offsets == (0,) * nd_b and local.lengths == tuple(buffer.shape)
            if known is not None and name in known and whole:
                value = known[name]
            else:
                value = view_digest(buffer[local.slices()] if buffer.dim() else buffer)
            out[region.index] = f"{value & (2**64 - 1):016x}"
            break
    return out


def replica_disagreement(regions: tuple[ReplicaRegion, ...], digests: Mapping[int, Mapping[int, str]],
                         names: Mapping[int, str]) -> str | None:
    """The first region whose ranks' digests differ (``digests``: rank -> region index ->
    digest; ``names``: rank -> member id), as one line naming the tensor, the region and
    the ranks; ``None`` when all agree. A rank without a digest for a region it holds is
    not compared (it did not publish the version)."""
    for region in regions:
        seen = {rank: digests[rank][region.index] for rank in region.ranks
                if rank in digests and region.index in digests[rank]}
        if len(set(seen.values())) > 1:
            first = region.ranks[0] if region.ranks[0] in seen else min(seen)
            other = next(r for r in sorted(seen) if seen[r] != seen[first])
            return (f"source replicas disagree on tensor {region.tensor!r} region {region.box}: "
                    f"rank {first} ({names.get(first, '?')}) and rank {other} ({names.get(other, '?')}) "
                    "hold different values")
    return None
