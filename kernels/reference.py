"""Torch reference of pack/unpack: plain slicing of byte views, one copy per region.

Used on CPU, as the ``backend="torch"`` of :class:`kernels.PackProgram`, and as the oracle the
Triton kernel is tested against. It deliberately shares nothing with the kernel's box
collapsing, so a bug there cannot hide in both.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .boxes import BoxRegion

__all__ = ["cast_copy", "copy_reference", "pack_reference", "unpack_reference"]


def _byte_box(tensor: torch.Tensor, region: BoxRegion) -> torch.Tensor:
    """The region's box of ``tensor`` as a (strided) uint8 view, last dim scaled to bytes."""
    isz = tensor.element_size()
    if tensor.dim() == 0:
        return tensor.reshape(1).view(torch.uint8)
    # view(uint8) of a contiguous tensor keeps the leading dims and scales the last one.
    tb = tensor.view(torch.uint8)
    *lead, last = zip(region.offsets, region.lengths, strict=True)
    index = tuple(slice(o, o + n) for o, n in lead)
    index += (slice(last[0] * isz, (last[0] + last[1]) * isz),)
    return tb[index]


def copy_reference(
    regions: Sequence[BoxRegion],
    tensors: Sequence[torch.Tensor],
    packed: torch.Tensor,
    *,
    pack: bool,
) -> None:
    """Copy every region between its box of ``tensors[region.tensor_index]`` and its bytes of
    ``packed`` (uint8): into ``packed`` when ``pack``, back into the tensors otherwise."""
    for region in regions:
        t = tensors[region.tensor_index]
        n = region.nbytes(t.element_size())
        if n == 0:
            continue
        box = _byte_box(t, region)
        flat = packed[region.packed_offset_bytes : region.packed_offset_bytes + n].view(box.shape)
        if pack:
            flat.copy_(box)
        else:
            box.copy_(flat)


def cast_copy(
    regions: Sequence[BoxRegion],
    tensors: Sequence[torch.Tensor],
    packed: torch.Tensor,
    packed_dtypes: Sequence[torch.dtype],
    *,
    pack: bool,
) -> None:
    """Like :func:`copy_reference` for regions whose packed dtype differs from their
    tensor's: each region's packed bytes hold its box in ``packed_dtypes[tensor_index]``.
    ``copy_`` between dtypes is the conversion ``Tensor.to`` runs, so a packed box is
    bit-for-bit ``box.to(packed_dtype)``."""
    for region in regions:
        t = tensors[region.tensor_index]
        dtype = packed_dtypes[region.tensor_index]
        itemsize = torch.empty((), dtype=dtype).element_size()
        n = region.numel * itemsize
        if n == 0:
            continue
        box = t.reshape(1) if t.dim() == 0 else t[tuple(slice(o, o + k) for o, k in zip(region.offsets, region.lengths, strict=True))]
        flat = packed[region.packed_offset_bytes : region.packed_offset_bytes + n]
        if flat.storage_offset() % itemsize == 0:  # a typed view of the packed bytes
            typed = flat.view(dtype).view(box.shape)
            if pack:
                typed.copy_(box)
            else:
                box.copy_(typed)
        elif pack:  # unaligned in the packed buffer: through a cast copy of the box
            flat.copy_(box.to(dtype).reshape(-1).view(torch.uint8))
        else:
            box.copy_(flat.clone().view(dtype).view(box.shape))


def pack_reference(
    regions: Sequence[BoxRegion], tensors: Sequence[torch.Tensor], out: torch.Tensor
) -> None:
    """Copy each region's box of ``tensors[region.tensor_index]`` into ``out`` (uint8)."""
    copy_reference(regions, tensors, out, pack=True)


def unpack_reference(
    regions: Sequence[BoxRegion], packed: torch.Tensor, tensors: Sequence[torch.Tensor]
) -> None:
    """Copy each region's packed bytes back into its box of ``tensors[region.tensor_index]``."""
    copy_reference(regions, tensors, packed, pack=False)
