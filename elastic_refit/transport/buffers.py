"""Byte views and checksums of the tensors a refit reads and writes."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from elastic_refit.plan import SourceSide

if TYPE_CHECKING:
    from elastic_refit.layout import Buffer
    from elastic_refit.transport.schedule import BufferRef

__all__ = ["buffer_digests", "buffers_digest", "byte_view", "combine_digests", "digest", "digest_reference", "fits", "overlapping",
           "resolve_buffers", "split_box", "view_digest"]


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
        if not fits(t, buffer, device):
            raise ValueError(f"rank {rank}: {what} buffer {name!r} must be contiguous on {device}")
        tensors[ref] = t
    return tensors


def fits(t: torch.Tensor, buffer: Buffer, device: torch.device) -> bool:
    """Whether ``t`` can stand for ``buffer`` on ``device``'s type: its shape and dtype,
    contiguous (what :func:`resolve_buffers` requires, and names when it is not so)."""
    return (tuple(t.shape) == buffer.shape and t.dtype == getattr(torch, buffer.dtype) and t.is_contiguous()
            and t.device.type == device.type)


try:  # the optional compiled form of the CPU digest (setup.py); numpy where it was not built
    from elastic_refit.transport import _digest as _native
except ImportError:
    _native = None

_MASK64 = (1 << 64) - 1
_DIGEST_ROW = 1 << 14  # words per row of a large digest's [rows, row] view (128 KiB)
_DIGEST_CHUNK = {"cpu": 1 << 21}  # bytes per step: 2 MiB stays in cache for the second reduction
_DIGEST_CHUNK_OTHER = 1 << 30  # accelerators: one step per GiB (launches are the cost there)


def digest(data: torch.Tensor) -> torch.Tensor:
    """Position-sensitive 64-bit checksum of a flat uint8 tensor (an int64 scalar tensor).

    The bytes, zero-padded to whole 8-byte words, are read as little-endian words
    ``x_0 .. x_{m-1}``; the checksum is ``(sum_p (2p + 1) * x_p mod 2**64) ^ n`` (``n`` the
    byte count), as a signed int64. It depends on the bytes only, never on how they sit in
    memory or how the sum is cut, so every device computes the same value
    (:func:`digest_reference` is the definition in plain Python). Every weight is odd, so
    a change of any single word (any byte or bit of it) always changes it; two swapped
    words ``p < q`` change it unless ``2 (q - p) (x_p - x_q)`` is a multiple of ``2**64``
    (adjacent words: unless they differ in the top bit only).

    One read of the bytes: ``sum_p p x_p = row * sum_i i R_i + sum_j j C_j`` over a
    ``[rows, row]`` view (``R`` its row sums, ``C`` its column sums), taken a few MiB at a
    time on a CPU so the column sums read what the row sums just brought into cache. Data
    at a byte offset that is not 8-aligned is copied through a chunk-sized scratch, never
    whole. On a CPU the sums run on one thread: torch's intra-op threads spin against each
    other when many ranks share few cores (40x slower, measured); there the compiled form
    (``_digest.c``: one pass, two adds a word) runs when it was built, else numpy."""
    data = data.detach().contiguous()  # a strided view: its bytes in order, copied
    if data.device.type == "cpu":
        array = data.numpy()
        if _native is not None:
            return torch.tensor(_finish_sum(_native.sum(array), array.size), dtype=torch.int64)
        return torch.tensor(_digest_cpu(array, data.storage_offset() % 8 == 0), dtype=torch.int64)
    return _digest_torch(data)


_RUN_BYTES_MIN = 256  # a strided view with shorter runs is copied: per-run work would cost more


def view_digest(view: torch.Tensor) -> int:
    """:func:`digest` of ``view``'s bytes in row-major order (what ``view.contiguous()``
    holds), as an int. A strided view on a CPU with the compiled form is read in place, one
    contiguous run after another, never copied: a replica region inside a fused buffer
    costs one read of its bytes instead of a copy and a read of the copy."""
    if view.device.type != "cpu" or _native is None or view.is_contiguous() or view.numel() == 0:
        return int(digest(byte_view(view.contiguous()).reshape(-1)))
    itemsize = view.element_size()
    dims = [(n, s) for n, s in zip(view.shape, view.stride(), strict=True) if n != 1]  # size 1: any stride
    run = 1  # elements per contiguous run: the trailing dims that follow each other in memory
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    if run * itemsize < _RUN_BYTES_MIN:
        return int(digest(byte_view(view.contiguous()).reshape(-1)))
    offsets = np.full(1, view.storage_offset() * itemsize, dtype=np.int64)
    for n, stride in dims:
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * (stride * itemsize)).reshape(-1)
    storage = view.untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
    return _finish_sum(_native.sum_runs(whole.numpy(), offsets, run * itemsize), view.numel() * itemsize)


def _finish_sum(h: int, n: int) -> int:
    """The digest (a signed int64) of ``n`` bytes whose weighted word sum is ``h``."""
    h ^= n
    return h - (1 << 64) if h >> 63 else h


def _finish(s0: int, s1: int, n: int) -> int:
    return _finish_sum((2 * s1 + s0) & _MASK64, n)


def _digest_cpu(data: np.ndarray, aligned: bool) -> int:
    n = data.size
    m = -(-n // 8)  # words, the last one zero-padded
    row = _DIGEST_ROW
    if m <= row:
        if n % 8 or not aligned:
            padded = np.zeros(m * 8, dtype=np.uint8)
            padded[:n] = data
            data = padded
        x = data.view(np.int64)
        return _finish(int(np.add.reduce(x)), int(np.dot(x, np.arange(m, dtype=np.int64))), n)
    rows = n // (8 * row)  # full rows; the rest (a partial row, a partial word) goes last
    step = max(1, _DIGEST_CHUNK["cpu"] // (8 * row))
    rest = n - rows * row * 8
    row_sums = np.empty(rows + (1 if rest else 0), dtype=np.int64)
    col_sums = np.zeros(row, dtype=np.int64)
    part = np.empty(row, dtype=np.int64)
    scratch = None if aligned else np.empty(min(step, rows) * row * 8, dtype=np.uint8)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        chunk = data[start * row * 8 : stop * row * 8]
        if scratch is not None:
            np.copyto(scratch[: chunk.size], chunk)
            chunk = scratch[: chunk.size]
        words = chunk.view(np.int64).reshape(stop - start, row)
        np.add.reduce(words, axis=1, out=row_sums[start:stop])
        np.add.reduce(words, axis=0, out=part)
        np.add(col_sums, part, out=col_sums)
    if rest:
        tail = np.zeros(-(-rest // 8) * 8, dtype=np.uint8)
        tail[:rest] = data[rows * row * 8 :]
        t = tail.view(np.int64)
        row_sums[rows] = np.add.reduce(t)
        col_sums[: t.size] += t
    s1 = (int(np.dot(row_sums, np.arange(row_sums.size, dtype=np.int64))) * row
          + int(np.dot(col_sums, np.arange(row, dtype=np.int64))))
    return _finish(int(np.add.reduce(row_sums)), s1, n)


def _digest_torch(data: torch.Tensor) -> torch.Tensor:
    """:func:`digest` in torch ops on ``data``'s device, in steps of a GiB."""
    n = data.numel()
    device = data.device
    m = -(-n // 8)
    if m <= _DIGEST_ROW:
        if n % 8 or data.storage_offset() % 8:
            padded = torch.zeros(m * 8, dtype=torch.uint8, device=device)
            padded[:n] = data
            data = padded
        x = data.view(torch.int64)
        s1 = (x * torch.arange(m, dtype=torch.int64, device=device)).sum()
        return (s1 * 2 + x.sum()) ^ n
    row = _DIGEST_ROW
    rows = n // (8 * row)
    step = max(1, _DIGEST_CHUNK.get(device.type, _DIGEST_CHUNK_OTHER) // (8 * row))
    rest = n - rows * row * 8
    row_sums = torch.empty(rows + (1 if rest else 0), dtype=torch.int64, device=device)
    col_sums = torch.zeros(row, dtype=torch.int64, device=device)
    scratch = None if data.storage_offset() % 8 == 0 else torch.empty(min(step, rows) * row * 8, dtype=torch.uint8,
                                                                      device=device)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        chunk = data[start * row * 8 : stop * row * 8]
        if scratch is not None:
            chunk = scratch[: chunk.numel()].copy_(chunk)
        words = chunk.view(torch.int64).view(stop - start, row)
        torch.sum(words, dim=1, out=row_sums[start:stop])
        col_sums += words.sum(dim=0)
    if rest:
        tail = torch.zeros(-(-rest // 8) * 8, dtype=torch.uint8, device=device)
        tail[:rest] = data[rows * row * 8 :]
        t = tail.view(torch.int64)
        torch.sum(t, dim=0, out=row_sums[rows])
        col_sums[: t.numel()] += t
    s1 = ((row_sums * torch.arange(row_sums.numel(), dtype=torch.int64, device=device)).sum() * row
          + (col_sums * torch.arange(row, dtype=torch.int64, device=device)).sum())
    return (s1 * 2 + row_sums.sum()) ^ n


def digest_reference(data: bytes) -> int:
    """:func:`digest` of ``data`` in plain Python (its definition; slow, for tests)."""
    n = len(data)
    padded = bytes(data) + bytes(-n % 8)
    h = 0
    for p in range(len(padded) // 8):
        h = (h + (2 * p + 1) * int.from_bytes(padded[8 * p : 8 * p + 8], "little")) & _MASK64
    h ^= n
    return h - (1 << 64) if h >> 63 else h


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
