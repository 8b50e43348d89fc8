"""Versions of position-dependent test data that change a little from one to the next, as
an RL policy's weights do: version 0 is the pattern of ``seed``; version ``k`` is version
``k - 1`` with about a ``density`` of its elements replaced (which ones, and by what, depend
on the tensor, the element's global index, ``seed`` and ``k`` only). So replicas of a
region agree, and a destination can rebuild what any version holds at its pieces without
the whole tensor (deltas' tests and demos)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from elastic_refit.layout import DTYPE_ITEMSIZE, DTYPES, Layout
from elastic_refit.testing.pattern import allocate, fill_pieces
from elastic_refit.transport.buffers import byte_view

__all__ = ["version_buffers", "version_problems"]


def _elements(buffers: Mapping[str, torch.Tensor], name: str, itemsize: int) -> torch.Tensor:
    return byte_view(buffers[name]).reshape(-1).view(-1, itemsize)


def version_buffers(layout: Layout, rank: int, version: int, *, density: float = 0.02, seed: int = 0,
                    fill: int = 0, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Rank ``rank``'s buffers of ``layout`` holding ``version`` (padding: ``fill``)."""
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {density}")
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    out = allocate(layout, rank, fill=fill, device=device)
    fill_pieces(layout, rank, out, seed)
    itemsizes = {layout.buffer_names[int(layout.buffer_name[b])]: DTYPE_ITEMSIZE[DTYPES[int(layout.buffer_dtype[b])]]
                 for b in range(layout.buffer_rank.size) if int(layout.buffer_rank[b]) == rank}
    threshold = round(density * 65536)
    for k in range(1, version + 1):
        chooser = allocate(layout, rank, fill=255, device=device)  # padding: never chosen
        fill_pieces(layout, rank, chooser, seed + 7919 * k)
        values = allocate(layout, rank, fill=fill, device=device)
        fill_pieces(layout, rank, values, seed + 104729 * k)
        for name, itemsize in itemsizes.items():
            first = _elements(chooser, name, itemsize)[:, :2].to(torch.int64)
            picked = (first[:, 0] * 256 + (first[:, 1] if itemsize > 1 else 0)) < threshold
            if itemsize == 1:
                picked = first[:, 0] < (threshold >> 8)
            rows = _elements(out, name, itemsize)
            rows[picked] = _elements(values, name, itemsize)[picked]
    return out


def version_problems(layout: Layout, rank: int, buffers: Mapping[str, torch.Tensor], version: int, *,
                     density: float = 0.02, seed: int = 0, fill: int = 0, limit: int = 5) -> list[str]:
    """Where ``buffers`` differ from :func:`version_buffers` (padding included)."""
    want = version_buffers(layout, rank, version, density=density, seed=seed, fill=fill,
                           device=next(iter(buffers.values())).device if buffers else "cpu")
    problems = []
    for name, expected in want.items():
        got = byte_view(buffers[name]).reshape(-1)
        differ = int((got != byte_view(expected).reshape(-1)).sum())
        if differ:
            problems.append(f"rank {rank} buffer {name!r}: {differ} bytes differ from version {version}")
            if len(problems) >= limit:
                break
    return problems
