"""Byte views and checksums of the tensors a refit reads and writes."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch

from elastic_refit.plan import SourceSide

if TYPE_CHECKING:
    from elastic_refit.layout import Buffer
    from elastic_refit.transport.schedule import BufferRef

__all__ = ["buffer_digests", "buffers_digest", "byte_view", "combine_digests", "digest", "overlapping", "resolve_buffers", "split_box"]


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The same storage as uint8, last dim scaled by the itemsize (tensor must be contiguous)."""
    if tensor.dtype == torch.uint8:
        return tensor
    if tensor.dim() == 0:
        return tensor.reshape(1).view(torch.uint8)
    return tensor.view(torch.uint8)


def resolve_buffers(buffers: Mapping[BufferRef, Buffer], source: Mapping[str, torch.Tensor],
                    destination: Mapping[str, torch.Tensor], *, rank: int,
                    device: torch.device) -> dict[BufferRef, torch.Tensor]:
    """The tensor of every buffer in ``buffers``, looked up by name in ``source`` or
    ``destination`` (by its side); ``ValueError`` for the first one that is missing, not of
    the layout's shape and dtype, or not contiguous on ``device``'s type."""
    tensors: dict[BufferRef, torch.Tensor] = {}
    for ref, buffer in buffers.items():
        side, name = ref
        given = source if side == int(SourceSide.SOURCE) else destination
        what = "source" if side == int(SourceSide.SOURCE) else "destination"
        if name not in given:
            raise ValueError(f"rank {rank}: {what} buffer {name!r} is missing")
        t = given[name]
        if tuple(t.shape) != buffer.shape or t.dtype != getattr(torch, buffer.dtype):
            raise ValueError(f"rank {rank}: {what} buffer {name!r} is {list(t.shape)} {t.dtype}, "
                             f"the layout says {list(buffer.shape)} {buffer.dtype}")
        if not t.is_contiguous() or t.device.type != device.type:
            raise ValueError(f"rank {rank}: {what} buffer {name!r} must be contiguous on {device}")
        tensors[ref] = t
    return tensors


_DIGEST_WIDTH = 1024  # words per row of the digest's view


def digest(data: torch.Tensor) -> torch.Tensor:
    """Position-sensitive 64-bit checksum of a flat uint8 tensor (an int64 scalar tensor).

    The bytes are read as int64 words in rows of 1024; the checksum weighs every column sum
    and every row sum by its position (and the words past the last full row by theirs), so
    a changed word, or two words swapped, changes it. Two reductions that read the data
    once each and write nothing of its size: it runs at memory speed on either device
    (about 4x the earlier multiply-then-sum form on a CPU)."""
    n = data.numel()
    words = -(-n // 8)
    if words * 8 != n or data.storage_offset() % 8:
        # int64 views need 8-byte alignment and length; boxes sit at any byte offset
        padded = torch.zeros(words * 8, dtype=torch.uint8, device=data.device)
        padded[:n] = data
        data = padded
    w = data.view(torch.int64)
    rows = words // _DIGEST_WIDTH
    main = w[: rows * _DIGEST_WIDTH].view(rows, _DIGEST_WIDTH)
    col = torch.arange(_DIGEST_WIDTH, dtype=torch.int64, device=w.device) * 2 + 1
    row = torch.arange(rows, dtype=torch.int64, device=w.device) * 0x9E3779B1 + 1
    h = (main.sum(dim=0) * col).sum() + (main.sum(dim=1) * row).sum()
    tail = w[rows * _DIGEST_WIDTH:]
    if tail.numel():
        h = h + (tail * (torch.arange(tail.numel(), dtype=torch.int64, device=w.device) * 0x85EBCA77 + 7)).sum()
    return h ^ n


def split_box(offsets: list[int], lengths: list[int], max_elements: int) -> Iterator[tuple[list[int], list[int]]]:
    """Cut a box into boxes of at most ``max_elements`` elements along its outer dims (a box
    of single elements is the smallest cut). Both ends of a message derive the same cuts, so
    no sizes travel."""
    d = next((j for j, n in enumerate(lengths) if n > 1), None)
    total = 1
    for n in lengths:
        total *= n
    if total <= max_elements or d is None:
        yield offsets, lengths
        return
    row = total // lengths[d]
    if row > max_elements:
        for i in range(lengths[d]):
            o, n = list(offsets), list(lengths)
            o[d], n[d] = offsets[d] + i, 1
            yield from split_box(o, n, max_elements)
        return
    step = max(1, max_elements // row)
    for start in range(0, lengths[d], step):
        o, n = list(offsets), list(lengths)
        o[d], n[d] = offsets[d] + start, min(step, lengths[d] - start)
        yield o, n


def buffer_digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Each named buffer's :func:`digest` (computed on its device), by name."""
    return {name: int(digest(byte_view(t).reshape(-1))) for name, t in tensors.items()}


def combine_digests(digests: Mapping[str, int]) -> str:
    """One hex digest of named buffer digests, keyed by name, in name order."""
    value = hashlib.blake2b(digest_size=16)
    for name in sorted(digests):
        value.update(f"{name}:{digests[name]};".encode())
    return value.hexdigest()


def buffers_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """One hex digest of named buffers: :func:`combine_digests` of :func:`buffer_digests`."""
    return combine_digests(buffer_digests(tensors))


def overlapping(tensors: Mapping[str, torch.Tensor]) -> tuple[str, str] | None:
    """The names (in name order) of two tensors whose bytes overlap in memory (the first
    such pair in address order), or ``None``. A view of another buffer would be overwritten by it."""
    spans = sorted(((str(t.device), t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size(),
                     t.numel() * t.element_size(), name) for name, t in tensors.items() if t.numel()),
                   key=lambda span: span[:3])
    for (device, start, size, name), (next_device, next_start, _, next_name) in itertools.pairwise(spans):
        if device == next_device and next_start < start + size:
            return min(name, next_name), max(name, next_name)
    return None
