"""Deterministic, position-dependent test data for refits of any size.

Every element of a logical tensor gets bytes derived from (tensor name, global index,
seed), so a source rank can fill its pieces and a destination rank can verify its pieces
bit-exactly without either materialising whole tensors.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import numpy as np
import torch

from elastic_refit.layout import Layout
from elastic_refit.transport.buffers import byte_view

_K1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_K2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_K3 = -7723592293110705685  # 0x94D049BB133111EB


def pattern_bytes(name: str, shape: tuple[int, ...], itemsize: int, offsets: tuple[int, ...],
                  lengths: tuple[int, ...], seed: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bytes of box (offsets, lengths) of tensor ``name``: uint8 ``[numel * itemsize]``."""
    strides = [1] * len(shape)  # row-major element strides
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * int(shape[d + 1])
    index = torch.zeros((), dtype=torch.int64, device=device)
    for d, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
        axis = torch.arange(o, o + n, dtype=torch.int64, device=device) * strides[d]
        index = index.unsqueeze(-1) + axis
    x = index.reshape(-1) * _K1 + ((zlib.crc32(name.encode()) << 20) ^ seed)
    x = x ^ (x >> 31)  # arithmetic shifts on int64 are fine for mixing
    x = x * _K2
    x = x ^ (x >> 29)
    x = x * _K3
    return x.view(torch.uint8).reshape(-1, 8)[:, :itemsize].reshape(-1)


def _local_view(buffer: torch.Tensor, local_offsets, local_lengths, itemsize: int) -> torch.Tensor:
    nd = buffer.dim()
    view = byte_view(buffer)
    slices = [slice(int(o), int(o + n)) for o, n in zip(local_offsets[: nd - 1], local_lengths[: nd - 1], strict=True)]
    last_o, last_n = int(local_offsets[nd - 1]), int(local_lengths[nd - 1])
    slices.append(slice(last_o * itemsize, (last_o + last_n) * itemsize))
    return view[tuple(slices)]


def _pieces_of(layout: Layout, rank: int):
    for p in np.flatnonzero(layout.piece_rank == rank).tolist():
        t = layout.tensors[int(layout.piece_tensor[p])]
        b = int(layout.piece_buffer[p])
        nd_t, nd_b = len(t.shape), int(layout.buffer_ndim[b])
        yield (
            p, t, layout.buffer_names[int(layout.buffer_name[b])],
            tuple(int(v) for v in layout.piece_offsets[p, :nd_t]),
            tuple(int(v) for v in layout.piece_lengths[p, :nd_t]),
            layout.piece_local_offsets[p, :nd_b], layout.piece_local_lengths[p, :nd_b],
        )


def fill_pieces(layout: Layout, rank: int, buffers: Mapping[str, torch.Tensor], seed: int = 0) -> int:
    """Write the pattern into every piece of ``rank``; returns bytes written."""
    total = 0
    for _, t, buffer, off, ln, loff, lln in _pieces_of(layout, rank):
        buf = buffers[buffer]
        region = _local_view(buf, loff, lln, t.itemsize)
        region.copy_(pattern_bytes(t.name, t.shape, t.itemsize, off, ln, seed, buf.device).reshape(region.shape))
        total += region.numel()
    return total


def check_pieces(layout: Layout, rank: int, buffers: Mapping[str, torch.Tensor], seed: int = 0,
                 limit: int = 5, cast_from: Mapping[str, str] | None = None) -> list[str]:
    """Compare every piece of ``rank`` with the pattern; returns up to ``limit`` mismatches.
    ``cast_from`` (``{tensor: source dtype}``): tensors published in another dtype, whose
    pattern was written in that dtype and must arrive as ``pattern.to(destination dtype)``."""
    problems: list[str] = []
    for p, t, buffer, off, ln, loff, lln in _pieces_of(layout, rank):
        buf = buffers[buffer]
        region = _local_view(buf, loff, lln, t.itemsize)
        if cast_from and t.name in cast_from:
            dtype = getattr(torch, cast_from[t.name])
            raw = pattern_bytes(t.name, t.shape, torch.empty((), dtype=dtype).element_size(), off, ln, seed, buf.device)
            want = byte_view(raw.view(dtype).to(getattr(torch, t.dtype)).contiguous()).reshape(region.shape)
        else:
            want = pattern_bytes(t.name, t.shape, t.itemsize, off, ln, seed, buf.device).reshape(region.shape)
        if not torch.equal(region, want):
            wrong = int((region != want).sum())
            problems.append(f"rank {rank} tensor {t.name!r} piece {layout.piece(p).box} in {buffer!r}: {wrong} bytes differ")
            if len(problems) >= limit:
                break
    return problems


def allocate(layout: Layout, rank: int, fill: int | None = 0, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Buffers of ``rank`` as torch tensors (``fill`` sets every byte; None leaves them empty)."""
    from elastic_refit.layout import DTYPES

    out: dict[str, torch.Tensor] = {}
    for b in np.flatnonzero(layout.buffer_rank == rank).tolist():
        nd = int(layout.buffer_ndim[b])
        shape = tuple(int(s) for s in layout.buffer_shape[b, :nd])
        dtype = getattr(torch, DTYPES[int(layout.buffer_dtype[b])])
        tensor = torch.empty(shape, dtype=dtype, device=device)
        if fill is not None:
            byte_view(tensor).fill_(fill)
        out[layout.buffer_names[int(layout.buffer_name[b])]] = tensor
    return out


# ---- finite data, for destinations in a quantized format --------------------------------
# The bytes above are any bit pattern: NaN and Inf included, which a quantized format refuses
# (a block with a non-finite element has no scale). Refits into FP8 use these values instead:
# finite, position-dependent like the bytes, with magnitudes from 2**-8 to 2**7 so blocks get
# scales of their own.
def finite_values(name: str, shape: tuple[int, ...], dtype: str, offsets: tuple[int, ...],
                  lengths: tuple[int, ...], seed: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """Finite values of box (offsets, lengths) of tensor ``name`` in ``dtype``, shaped
    ``lengths``; the same for any box at the same global positions."""
    raw = pattern_bytes(name, shape, 8, offsets, lengths, seed, device).view(torch.int64)
    mantissa = ((raw & 0xFFFF) - 0x8000).double() / 0x8000  # in [-1, 1)
    exponent = ((raw >> 16) & 0xF) - 8  # 2**-8 .. 2**7
    values = (mantissa * torch.exp2(exponent.double())).reshape(lengths)
    return values.to(getattr(torch, dtype))


def fill_finite(layout: Layout, rank: int, buffers: Mapping[str, torch.Tensor], seed: int = 0) -> None:
    """Write :func:`finite_values` into every piece of ``rank``."""
    for _, t, buffer, off, ln, loff, lln in _pieces_of(layout, rank):
        buf = buffers[buffer]
        region = buf[tuple(slice(int(o), int(o + n)) for o, n in zip(loff, lln, strict=True))]
        region.copy_(finite_values(t.name, t.shape, t.dtype, off, ln, seed, buf.device).reshape(region.shape))


def check_quantized(layout: Layout, formats, rank: int, buffers: Mapping[str, torch.Tensor], seed: int = 0,
                    limit: int = 5) -> list[str]:
    """Compare every byte ``rank`` holds of destination ``layout`` (logical dtypes) in
    ``formats`` (its FP8 weights, their scales, and the tensors kept as they are) with what it
    must hold after a refit of :func:`finite_values` published with ``seed``: the FP8 bytes
    and scales of ``kernels.quantize.quantize_reference`` of each whole tensor, the finite
    values themselves elsewhere. Returns up to ``limit`` mismatches."""
    from elastic_refit.kernels.quantize import quantize_reference
    from elastic_refit.plan import destination_format_layout

    held = destination_format_layout(layout, formats)
    logical = {t.name: t for t in layout.tensors}
    whole: dict[str, torch.Tensor] = {}  # tensor (or scale tensor) name -> what the destination holds of it
    for name, fmt in formats.entries:
        t = logical[name]
        x = finite_values(name, t.shape, t.dtype, (0,) * len(t.shape), t.shape, seed)
        whole[name], whole[fmt.scale_name(name)] = quantize_reference(x, fmt, name=name)
    problems: list[str] = []
    for p, t, buffer, off, ln, loff, lln in _pieces_of(held, rank):
        buf = buffers[buffer]
        region = buf[tuple(slice(int(o), int(o + n)) for o, n in zip(loff, lln, strict=True))]
        if t.name in whole:
            want = whole[t.name][tuple(slice(o, o + n) for o, n in zip(off, ln, strict=True))]
        else:
            want = finite_values(t.name, t.shape, t.dtype, off, ln, seed)
        got, want = byte_view(region.contiguous().cpu()), byte_view(want.contiguous().reshape(region.shape))
        if not torch.equal(got, want):
            problems.append(f"rank {rank} tensor {t.name!r} piece {held.piece(p).box} in {buffer!r}: "
                            f"{int((got != want).sum())} bytes differ")
            if len(problems) >= limit:
                break
    return problems
