"""Copy many N-d boxes to or from contiguous byte spans of *other* tensors, in one launch.

The executor's pack kernel moves boxes of some tensors to one packed buffer. A destination
that reads a peer's memory directly (CUDA IPC) has no packed buffer: when its box is one
contiguous span of its own buffer, the source's (strided) box is gathered straight into it,
and when the source's box is one contiguous span, it is scattered straight into the
destination's box. One copy, no staging. :class:`SpanCopy` is that: every item names a box
of a "box tensor" and a byte offset in a "span tensor", and one launch of the same Triton
kernel copies them all (``gather``: box to span; otherwise span to box).

The kernel forms every address from one base pointer plus a signed byte offset, so the
spans may lie in any tensors, another process's mapped memory included; the descriptors are
resolved for the tensors' addresses and cached by them.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from elastic_refit.kernels import BoxRegion
from elastic_refit.kernels import _triton_backend as triton_backend
from elastic_refit.kernels.boxes import entries_for

__all__ = ["SpanCopy", "SpanItem"]

_DESC_WORDS = 12
_TILE_BYTES = 8192
_NUM_WARPS = 4
_CACHE = 8


@dataclass(frozen=True, slots=True)
class SpanItem:
    """Box ``offsets``/``lengths`` of box tensor ``box_tensor`` <-> the same bytes, row-major,
    at ``span_offset`` of span tensor ``span_tensor``."""

    box_tensor: int
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    span_tensor: int
    span_offset: int

    def __post_init__(self) -> None:
        if self.box_tensor < 0 or self.span_tensor < 0 or self.span_offset < 0:
            raise ValueError(f"indices and offsets must be >= 0, got {self}")
        if len(self.offsets) != len(self.lengths):
            raise ValueError(f"offsets {self.offsets} and lengths {self.lengths} differ in rank")


def _align_log2(ptr: int) -> int:
    return (math.gcd(ptr, 16) or 16).bit_length() - 1


class SpanCopy:
    """``items`` between boxes of tensors of ``shapes``/``dtypes`` and byte spans; built once
    per epoch, run every refit. ``backend``: "triton" (one launch, CUDA or Triton's CPU
    interpreter), "torch" (one slice copy per item), "auto" (Triton on CUDA)."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype], items: Sequence[SpanItem],
                 *, gather: bool, device: torch.device, backend: str = "auto") -> None:
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be auto, torch or triton, got {backend!r}")
        if backend == "auto":
            backend = "triton" if device.type == "cuda" and triton_backend.HAVE_TRITON else "torch"
        self.backend = backend
        self.shapes = tuple(tuple(s) for s in shapes)
        self.dtypes = tuple(dtypes)
        self.itemsizes = tuple(torch.empty((), dtype=d).element_size() for d in self.dtypes)
        self.items = tuple(i for i in items if math.prod(i.lengths) > 0)
        for i in self.items:
            shape = self.shapes[i.box_tensor]
            if len(shape) != len(i.offsets) or any(o + n > s for o, n, s in zip(i.offsets, i.lengths, shape, strict=True)):
                raise ValueError(f"box {i.offsets}+{i.lengths} is outside tensor {i.box_tensor} of shape {shape}")
        self.gather = gather
        self.device = device
        self.nbytes = sum(math.prod(i.lengths) * self.itemsizes[i.box_tensor] for i in self.items)
        self._descs: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        if self.backend == "triton":
            self._build()

    def _build(self) -> None:
        rows, spans, tiles = [], [], []
        first = 0
        for item in self.items:
            region = BoxRegion(item.box_tensor, item.offsets, item.lengths, item.span_offset)
            for e in entries_for(region, self.shapes[item.box_tensor], self.itemsizes[item.box_tensor]):
                (_n0, s0), (n1, s1), (n2, s2) = e.dims
                ntiles = -(-e.nbytes // _TILE_BYTES)
                rows.append((e.tensor_index, e.tensor_offset, e.packed_offset, e.row_bytes, n1, n2, s0, s1, s2,
                             e.width_log2, first, e.nbytes))
                spans.append(item.span_tensor)
                tiles.append(ntiles)
                first += ntiles
        if first >= 2**31:
            raise ValueError(f"{first} tiles exceed the launch grid")
        self._desc = np.asarray(rows, dtype=np.int64).reshape(-1, _DESC_WORDS)
        self._span_of = np.asarray(spans, dtype=np.int64)
        self._num_tiles = first
        self._tile_region = torch.from_numpy(
            np.repeat(np.arange(len(rows), dtype=np.int32), np.asarray(tiles, dtype=np.int64))).to(self.device)

    def run(self, box_tensors: Sequence[torch.Tensor], span_tensors: Sequence[torch.Tensor]) -> None:
        """Copy every item (on the current stream). ``span_tensors`` are contiguous; a span
        is addressed in bytes from the tensor's first byte."""
        if not self.items:
            return
        if self.backend == "torch":
            self._run_torch(box_tensors, span_tensors)
            return
        base = span_tensors[0]
        desc = self._resolved(box_tensors, span_tensors, base.data_ptr())
        triton_backend.launch(buf=base.view(torch.uint8).reshape(-1), desc=desc, tile_region=self._tile_region,
                              num_tiles=self._num_tiles, pack=self.gather, tile_bytes=_TILE_BYTES,
                              num_warps=_NUM_WARPS)

    def _resolved(self, boxes: Sequence[torch.Tensor], spans: Sequence[torch.Tensor], bptr: int) -> torch.Tensor:
        box_ptrs = [t.data_ptr() for t in boxes]
        span_ptrs = [t.data_ptr() for t in spans]
        key = (bptr, *box_ptrs, -1, *span_ptrs)
        desc = self._descs.get(key)
        if desc is not None:
            self._descs.move_to_end(key)
            return desc
        host = self._desc.copy()
        bp = np.asarray(box_ptrs, dtype=np.uint64).view(np.int64)
        sp = np.asarray(span_ptrs, dtype=np.uint64).view(np.int64)
        b0 = np.int64(np.uint64(bptr).view(np.int64))
        ti, si = host[:, 0].copy(), self._span_of
        host[:, 0] = bp[ti] - b0
        host[:, 2] += sp[si] - b0
        cap = np.minimum(np.asarray([_align_log2(p) for p in box_ptrs])[ti],
                         np.asarray([_align_log2(p) for p in span_ptrs])[si])
        host[:, 9] = np.minimum(host[:, 9], np.minimum(cap, _align_log2(bptr)))
        desc = torch.from_numpy(host).to(self.device)
        self._descs[key] = desc
        if len(self._descs) > _CACHE:
            self._descs.popitem(last=False)
        return desc

    def _run_torch(self, boxes: Sequence[torch.Tensor], spans: Sequence[torch.Tensor]) -> None:
        for item in self.items:
            t = boxes[item.box_tensor]
            box = _byte_box(t, item.offsets, item.lengths)
            n = box.numel()
            flat = spans[item.span_tensor].view(torch.uint8).reshape(-1)[item.span_offset : item.span_offset + n]
            if self.gather:
                flat.view(box.shape).copy_(box)
            else:
                box.copy_(flat.view(box.shape))


def _byte_box(tensor: torch.Tensor, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    """The box of ``tensor`` as a strided uint8 view (last dim in bytes)."""
    isz = tensor.element_size()
    if tensor.dim() == 0:
        return tensor.reshape(1).view(torch.uint8)
    tb = tensor.view(torch.uint8)
    index = tuple(slice(o, o + n) for o, n in zip(offsets[:-1], lengths[:-1], strict=True))
    return tb[(*index, slice(offsets[-1] * isz, (offsets[-1] + lengths[-1]) * isz))]
