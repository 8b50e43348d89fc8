"""Fused pack + quantize of many boxes in one launch, and the inverse unpack.

A :class:`QuantRegion` is a box of a local BF16 tensor whose blocks are whole (the planner
cuts boxes on block boundaries of the global tensor; partial blocks only at the tensor's
edge): its block grid starts at the box's first element. Packing writes the box's E4M3 bytes
(row-major box order, one byte per element) at ``packed_offset_bytes`` and its scales
(row-major over the box's block grid ``[..., ceil(rows / BR), ceil(cols / BC)]``) at
``scale_offset_bytes`` of one uint8 bucket; a region with ``data_strides`` /
``scale_strides`` writes them strided instead (a box of a larger FP8 tensor and of its
scale tensor, both views of the bucket: how the executor's senders quantize into their
staging). Unpacking places both into the destination's FP8 weight and scale tensors; that is two plain box copies per region, so it is a
:class:`PackProgram` over derived regions and reuses its kernel.

A bucket may hold regions of several formats (and plain BF16 ones): one program per format
over the same buffer.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from . import _triton_backend
from .boxes import BoxRegion
from .program import BACKENDS, PackProgram, _canonical_device, _check_shape
from .quantize import (
    BlockScheme,
    NonFiniteBlockError,
    as_scheme,
    block_amax,
    poisoned,
    quantize_with_scales,
    scales_from_amax,
)

__all__ = ["QuantPackProgram", "QuantRegion", "QuantUnpackProgram", "quant_regions_nbytes"]

_QUANT_SOURCE = "_triton_quant.py"
_DESC_WORDS = 12
_TABLE_CACHE = 16
_TILE_ELEMENTS = 4096  # elements one pass of a program holds in registers


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, slots=True)
class QuantRegion:
    """One box of one tensor, and where its E4M3 bytes and its scales go in the bucket.

    The box is ``tensor[offsets[0]:offsets[0]+lengths[0], ...]`` (rank >= 2; blocks tile its
    last two dims from its first element). Its ``prod(lengths)`` E4M3 bytes sit at
    ``packed_offset_bytes``, its scales at ``scale_offset_bytes``.
    """

    tensor_index: int
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    packed_offset_bytes: int
    scale_offset_bytes: int
    # Strided output (None: packed row-major): bytes between FP8 elements along each dim,
    # and scales between entries of the block grid along each dim; rows stay contiguous
    # (last stride 1). Strided regions are not checked for overlap among themselves: they
    # are boxes of tensors whose layout keeps them apart.
    data_strides: tuple[int, ...] | None = None
    scale_strides: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        BoxRegion(self.tensor_index, self.offsets, self.lengths, self.packed_offset_bytes)  # the box's own checks
        if len(self.offsets) < 2:
            raise ValueError(f"offsets {self.offsets} and lengths {self.lengths} must have one rank >= 2")
        if not _is_int(self.scale_offset_bytes) or self.scale_offset_bytes < 0:
            raise ValueError(f"scale_offset_bytes must be an int >= 0, got {self.scale_offset_bytes!r}")
        for what in ("data_strides", "scale_strides"):
            strides = getattr(self, what)
            if strides is None:
                continue
            strides = tuple(strides)
            if len(strides) != len(self.lengths) or not all(_is_int(v) and v >= 1 for v in strides) or strides[-1] != 1:
                raise ValueError(f"{what} must be {len(self.lengths)} ints >= 1 ending in 1, got {getattr(self, what)!r}")
            object.__setattr__(self, what, strides)
        if self.data_strides is not None and self.data_strides[-2] < self.lengths[-1]:
            raise ValueError(f"data_strides {self.data_strides}: rows of {self.lengths[-1]} bytes would overlap")

    @property
    def strided(self) -> bool:
        return self.data_strides is not None or self.scale_strides is not None

    def data_strides_of(self) -> tuple[int, ...]:
        """Bytes between FP8 elements along each dim (row-major over the box unless given)."""
        return self.data_strides if self.data_strides is not None else _dense(self.lengths)

    def scale_strides_of(self, fmt: object) -> tuple[int, ...]:
        """Scales between entries of the box's block grid along each dim."""
        return self.scale_strides if self.scale_strides is not None else _dense(self.block_lengths(fmt))

    def data_end(self) -> int:
        """One past the last FP8 byte the region writes (0 when empty)."""
        return _end(self.packed_offset_bytes, self.lengths, self.data_strides_of(), 1) if self.numel else 0

    def scale_end(self, fmt: object) -> int:
        """One past the last scale byte the region writes (0 when empty)."""
        if not self.numel:
            return 0
        isz = as_scheme(fmt).scale_itemsize
        return _end(self.scale_offset_bytes, self.block_lengths(fmt), self.scale_strides_of(fmt), isz)

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    def block_lengths(self, fmt: object) -> tuple[int, ...]:
        """The box's block grid: leading lengths, then blocks per row and column."""
        br, bc = as_scheme(fmt).block_shape
        *lead, rows, cols = self.lengths
        return (*lead, -(-rows // br), -(-cols // bc))

    def num_blocks(self, fmt: object) -> int:
        return math.prod(self.block_lengths(fmt)) if self.numel else 0

    def scale_nbytes(self, fmt: object) -> int:
        return self.num_blocks(fmt) * as_scheme(fmt).scale_itemsize


def _dense(lengths: Sequence[int]) -> tuple[int, ...]:
    strides = [1] * len(lengths)
    for k in range(len(lengths) - 2, -1, -1):
        strides[k] = strides[k + 1] * max(int(lengths[k + 1]), 1)
    return tuple(strides)


def _end(offset: int, lengths: Sequence[int], strides: Sequence[int], itemsize: int) -> int:
    return offset + (sum((n - 1) * s for n, s in zip(lengths, strides, strict=True)) + 1) * itemsize


def quant_regions_nbytes(regions: Sequence[QuantRegion], fmt: object) -> int:
    """Bytes a bucket needs for ``regions``: the end of the last data or scale range."""
    return max((max(r.data_end(), r.scale_end(fmt)) for r in regions), default=0)


def _tiles(scheme: BlockScheme, chunk_rows: int | None = None) -> tuple[int, int, int]:
    """(TR, TC, CR) of the kernel for a block shape: tiles of whole blocks, CR-row passes
    (``chunk_rows``, a power of two dividing TR; default: ~4096 elements per pass)."""
    br = scheme.block_shape[0]
    if scheme.kind == "mxfp8":
        side_r, side_c, chunk = 32, 128, 32
    else:
        side_r = side_c = max(br, 64)
        chunk = side_r if side_r * side_c <= _TILE_ELEMENTS else max(_TILE_ELEMENTS // side_c, 1)
    if chunk_rows is not None:
        # Chunks only split blocks as tall as the tile; smaller blocks take one pass.
        if chunk_rows & (chunk_rows - 1) or not 1 <= chunk_rows <= side_r or (chunk_rows < side_r and br != side_r):
            raise ValueError(f"chunk_rows must be a power of two <= {side_r} (and < {side_r} only for "
                             f"{side_r}-row blocks), got {chunk_rows!r}")
        chunk = chunk_rows
    return side_r, side_c, chunk


@dataclass(frozen=True, slots=True)
class _Group:
    """Entries launched together (same whole-tile rows / columns and static alignment)."""

    desc: np.ndarray  # [entries, 10]; word 0 = tensor index until resolved
    entry_tensor: np.ndarray
    tile_entry: torch.Tensor
    num_tiles: int
    even_rows: bool
    even_cols: bool
    aligned: bool  # before pointers are known


class QuantPackProgram:
    """Quantize many boxes of many BF16 tensors into one uint8 bucket, in one launch per
    group of similar boxes (at most four).

    ``fmt``: a quantized destination format (``DestinationFormat`` or :class:`BlockScheme`).
    ``backend``: ``"triton"`` (compiled on CUDA, interpreted on CPU), ``"torch"`` (the
    reference functions per region), ``"auto"`` (Triton on CUDA when installed).
    ``names`` (optional, one per tensor) name tensors in errors. ``soft_cast``: integer
    E4M3 conversion in the kernel instead of the hardware one (default: only when
    interpreted, where Triton's conversion is inexact). ``num_warps`` and ``chunk_rows``
    (rows per pass of a 128-row block: fewer registers, two reads; ``128``: one pass) tune
    the kernel.

    Packing never raises for data: a block with NaN/Inf is written poisoned (NaN scale,
    0x7f bytes, see ``kernels.quantize``); :meth:`check` raises
    :class:`NonFiniteBlockError` for the first one, naming the tensor and block.
    """

    def __init__(
        self,
        shapes: Sequence[Sequence[int]],
        regions: Sequence[QuantRegion | tuple],
        fmt: object,
        *,
        dtypes: Sequence[torch.dtype] | None = None,
        device: torch.device | str = "cpu",
        backend: str = "auto",
        names: Sequence[str] | None = None,
        soft_cast: bool | None = None,
        num_warps: int = 8,
        chunk_rows: int | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.scheme = as_scheme(fmt)
        self.shapes = tuple(_check_shape(i, s) for i, s in enumerate(shapes))
        self.dtypes = tuple(dtypes) if dtypes is not None else (torch.bfloat16,) * len(self.shapes)
        if len(self.dtypes) != len(self.shapes):
            raise ValueError(f"{len(self.shapes)} shapes but {len(self.dtypes)} dtypes")
        self.names = tuple(names) if names is not None else tuple(f"tensor {i}" for i in range(len(self.shapes)))
        if len(self.names) != len(self.shapes):
            raise ValueError(f"{len(self.shapes)} shapes but {len(self.names)} names")
        self.device = _canonical_device(torch.device(device))
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" and _triton_backend.HAVE_TRITON else "torch"
        self.backend = backend
        if backend == "triton":
            bad = [i for i, dt in enumerate(self.dtypes) if dt != torch.bfloat16]
            if bad:
                raise ValueError(f"backend 'triton' quantizes bfloat16 tensors; tensor {bad[0]} is {self.dtypes[bad[0]]}")
        self.soft_cast = self.device.type != "cuda" if soft_cast is None else bool(soft_cast)
        self.num_warps = num_warps
        self.tiles = _tiles(self.scheme, chunk_rows)
        self.regions = tuple(self._check_region(i, r) for i, r in enumerate(regions))
        self.nbytes = quant_regions_nbytes(self.regions, self.scheme)
        self._check_packed_overlap()
        self._groups = self._build_groups() if backend == "triton" else ()
        self._descs: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, bool]]] = OrderedDict()

    # -- validation ---------------------------------------------------------------------
    def _check_region(self, i: int, region: QuantRegion | tuple) -> QuantRegion:
        if not isinstance(region, QuantRegion):
            try:
                ti, offs, lens, poff, soff, *strides = region
                region = QuantRegion(ti, tuple(offs), tuple(lens), poff, soff, *strides)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"region {i}: {region!r} is not a QuantRegion: {exc}") from exc
        if region.tensor_index >= len(self.shapes):
            raise ValueError(f"region {i}: tensor_index {region.tensor_index} out of range for {len(self.shapes)} tensors")
        shape = self.shapes[region.tensor_index]
        if len(region.offsets) != len(shape):
            raise ValueError(f"region {i}: box of rank {len(region.offsets)} for {self.names[region.tensor_index]} of shape {shape}")
        for d, (o, n, s) in enumerate(zip(region.offsets, region.lengths, shape, strict=True)):
            if o + n > s:
                raise ValueError(
                    f"region {i}: box {region.offsets}+{region.lengths} out of bounds of "
                    f"{self.names[region.tensor_index]} shape {shape} in dim {d} ({o} + {n} > {s})"
                )
        if region.scale_offset_bytes % self.scheme.scale_itemsize:
            raise ValueError(
                f"region {i}: scale_offset_bytes {region.scale_offset_bytes} is not a multiple of "
                f"the scale size {self.scheme.scale_itemsize}"
            )
        return region

    def _check_packed_overlap(self) -> None:
        spans = []
        for i, r in enumerate(self.regions):
            if r.numel and not r.strided:
                spans.append((r.packed_offset_bytes, r.packed_offset_bytes + r.numel, i, "data"))
                spans.append((r.scale_offset_bytes, r.scale_offset_bytes + r.scale_nbytes(self.scheme), i, "scales"))
        spans.sort()
        for (s0, e0, i0, w0), (s1, e1, i1, w1) in itertools.pairwise(spans):
            if s1 < e0:
                raise ValueError(
                    f"region {i0} {w0} [{s0}, {e0}) and region {i1} {w1} [{s1}, {e1}) overlap in the bucket"
                )

    def _check_args(self, tensors: Sequence[torch.Tensor], buf: torch.Tensor) -> None:
        if len(tensors) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} tensors, got {len(tensors)}")
        for i, t in enumerate(tensors):
            if tuple(t.shape) != self.shapes[i] or t.dtype != self.dtypes[i] or not t.is_contiguous() or t.device != self.device:
                raise ValueError(
                    f"{self.names[i]}: got {t.dtype} {tuple(t.shape)} on {t.device} (contiguous: "
                    f"{t.is_contiguous()}), program wants contiguous {self.dtypes[i]} {self.shapes[i]} on {self.device}"
                )
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise ValueError(f"bucket must be a contiguous 1-D torch.uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
        if buf.numel() < self.nbytes:
            raise ValueError(f"bucket has {buf.numel()} bytes, the program needs {self.nbytes}")
        if buf.device != self.device:
            raise ValueError(f"bucket is on {buf.device}, program is on {self.device}")
        if self._groups and buf.data_ptr() % 4:
            raise ValueError(f"bucket address {buf.data_ptr():#x} is not 4-byte aligned (float32 scales)")

    # -- Triton plan --------------------------------------------------------------------
    def _build_groups(self) -> tuple[_Group, ...]:
        tr, tc, _cr = self.tiles
        bc = self.scheme.block_shape[1]
        isz = self.scheme.scale_itemsize
        rows_by_key: dict[tuple[bool, bool, bool], list[list[int]]] = {}
        for r in self.regions:
            if not r.numel:
                continue
            shape = self.shapes[r.tensor_index]
            strides = [1] * len(shape)
            for k in range(len(shape) - 2, -1, -1):
                strides[k] = strides[k + 1] * shape[k + 1]
            *lead_o, r0, c0 = r.offsets
            *lead_n, rows, cols = r.lengths
            nbc = -(-cols // bc)
            d_str, s_str = r.data_strides_of(), r.scale_strides_of(self.scheme)
            even = (rows % tr == 0, cols % tc == 0)
            for idx in itertools.product(*(range(n) for n in lead_n)):
                t_off = sum((o + j) * s for o, j, s in zip(lead_o, idx, strides, strict=False)) + r0 * shape[-1] + c0
                p_off = r.packed_offset_bytes + sum(j * s for j, s in zip(idx, d_str, strict=False))
                s_off = r.scale_offset_bytes + sum(j * s for j, s in zip(idx, s_str, strict=False)) * isz
                aligned = ((t_off * 2) % 16 == 0 and (shape[-1] * 2) % 16 == 0 and p_off % 16 == 0
                           and cols % 16 == 0 and d_str[-2] % 16 == 0)
                tiles = -(-rows // tr) * -(-cols // tc)
                rows_by_key.setdefault((*even, aligned), []).append(
                    [r.tensor_index, t_off, shape[-1], rows, cols, p_off, s_off, -(-cols // tc), tiles, nbc,
                     d_str[-2], s_str[-2]]
                )
        groups = []
        for (even_rows, even_cols, aligned), rows_ in sorted(rows_by_key.items()):
            desc = np.asarray(rows_, dtype=np.int64)
            tiles = desc[:, 8].copy()
            desc[:, 8] = np.concatenate([[0], np.cumsum(tiles)[:-1]])
            total = int(tiles.sum())
            if total >= 2**31:
                raise ValueError(f"{total} tiles exceed the launch grid")
            tile_entry = np.repeat(np.arange(len(rows_), dtype=np.int32), tiles)
            groups.append(_Group(desc, desc[:, 0].copy(), torch.from_numpy(tile_entry).to(self.device),
                                 total, even_rows, even_cols, aligned))
        return tuple(groups)

    def _resolved(self, tensors: Sequence[torch.Tensor], buf: torch.Tensor) -> list[tuple[torch.Tensor, bool]]:
        bptr = buf.data_ptr()
        key = (bptr, *(t.data_ptr() for t in tensors))
        cached = self._descs.get(key)
        if cached is not None:
            self._descs.move_to_end(key)
            return cached
        ptrs = np.asarray(key[1:], dtype=np.uint64).view(np.int64)
        out = []
        for g in self._groups:
            host = g.desc.copy()
            delta = ptrs[g.entry_tensor] - np.int64(np.uint64(bptr).view(np.int64))
            host[:, 0] = delta
            aligned = g.aligned and bptr % 16 == 0 and bool(np.all(delta % 16 == 0))
            out.append((torch.from_numpy(host).to(self.device), aligned))
        self._descs[key] = out
        if len(self._descs) > _TABLE_CACHE:
            self._descs.popitem(last=False)
        return out

    def _launch(self, tensors: Sequence[torch.Tensor], buf: torch.Tensor) -> None:
        mod = _triton_backend.load_source(_QUANT_SOURCE, interpret=buf.device.type != "cuda")
        tr, tc, cr = self.tiles
        br, bc = self.scheme.block_shape
        kind = 0 if self.scheme.kind == "fp8-block" else 1
        for g, (desc, aligned) in zip(self._groups, self._resolved(tensors, buf), strict=True):
            mod.quant_pack_kernel[(g.num_tiles,)](
                buf, desc, g.tile_entry, KIND=kind, BR=br, BC=bc, TR=tr, TC=tc, CR=cr,
                EVEN_ROWS=g.even_rows, EVEN_COLS=g.even_cols, ALIGNED=aligned, SOFT_CAST=self.soft_cast,
                num_warps=self.num_warps,
            )

    # -- public -------------------------------------------------------------------------
    @property
    def num_launches(self) -> int:
        """Kernel launches per :meth:`pack` (0 for the torch backend)."""
        return len(self._groups)

    def pack(self, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Quantize every region of ``tensors`` into the bucket ``out``; returns ``out``.
        Bytes outside the regions' data and scale ranges are left as they were."""
        self._check_args(tensors, out)
        if self._groups:
            self._launch(tensors, out)
        elif self.backend == "torch":
            self._pack_torch(tensors, out)
        return out

    def _pack_torch(self, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        for i, r in enumerate(self.regions):
            if not r.numel:
                continue
            box = tensors[r.tensor_index][tuple(slice(o, o + n) for o, n in zip(r.offsets, r.lengths, strict=True))]
            scales = scales_from_amax(block_amax(box, self.scheme), self.scheme)
            q = quantize_with_scales(box, scales, self.scheme)
            out[r.packed_offset_bytes :].as_strided(r.lengths, r.data_strides_of()).copy_(q.view(torch.uint8))
            self.scales(out, i).copy_(scales)

    def scales(self, buf: torch.Tensor, index: int) -> torch.Tensor:
        """Region ``index``'s scales in ``buf``, shaped as its block grid (a view)."""
        r = self.regions[index]
        raw = buf[r.scale_offset_bytes : r.scale_end(self.scheme)].view(self.scheme.scale_dtype)
        return raw.as_strided(r.block_lengths(self.scheme), r.scale_strides_of(self.scheme))

    def check(self, buf: torch.Tensor) -> None:
        """Raise :class:`NonFiniteBlockError` for the first poisoned block in ``buf`` (one
        device sync), naming the tensor and the block in the tensor's local block grid."""
        br, bc = self.scheme.block_shape
        flags = []
        for i, r in enumerate(self.regions):
            if r.numel:
                s = self.scales(buf, i)
                flags.append((i, poisoned(s, self.scheme).any()))
        if not flags or not bool(torch.stack([f for _, f in flags]).any()):
            return
        for i, f in flags:
            if bool(f):
                r = self.regions[i]
                s = self.scales(buf, i)
                idx = [int(v) for v in torch.nonzero(poisoned(s, self.scheme))[0].tolist()]
                *lead, rb, cb = idx
                block = (*(o + j for o, j in zip(r.offsets[:-2], lead, strict=True)),
                         r.offsets[-2] // br + rb, r.offsets[-1] // bc + cb)
                offsets = (*block[:-2], r.offsets[-2] + rb * br, r.offsets[-1] + cb * bc)
                lengths = (*(1,) * len(lead), min(br, r.lengths[-2] - rb * br), min(bc, r.lengths[-1] - cb * bc))
                raise NonFiniteBlockError(self.names[r.tensor_index], block, (offsets, lengths))

    def __repr__(self) -> str:
        return (f"QuantPackProgram(tensors={len(self.shapes)}, regions={len(self.regions)}, "
                f"nbytes={self.nbytes}, scheme={self.scheme.kind}{self.scheme.block_shape}, "
                f"backend={self.backend!r}, device={str(self.device)!r})")


class QuantUnpackProgram:
    """Place packed E4M3 bytes and scales into destination weight and scale tensors.

    ``weight_shapes[i]`` is a local float8_e4m3fn weight, ``scale_shapes[i]`` its scale
    tensor (float32 or uint8 E8M0 codes; the block grid of the weight). A region's box
    must start on a block boundary of the local weight and end on one or at its edge (its
    scales are then one box of the scale tensor). One :class:`PackProgram` does the work.
    """

    def __init__(
        self,
        weight_shapes: Sequence[Sequence[int]],
        scale_shapes: Sequence[Sequence[int]],
        regions: Sequence[QuantRegion | tuple],
        fmt: object,
        *,
        device: torch.device | str = "cpu",
        backend: str = "auto",
        names: Sequence[str] | None = None,
    ) -> None:
        self.scheme = as_scheme(fmt)
        weights = tuple(_check_shape(i, s) for i, s in enumerate(weight_shapes))
        scales = tuple(_check_shape(i, s) for i, s in enumerate(scale_shapes))
        if len(weights) != len(scales):
            raise ValueError(f"{len(weights)} weight shapes but {len(scales)} scale shapes")
        names = tuple(names) if names is not None else tuple(f"tensor {i}" for i in range(len(weights)))
        br, bc = self.scheme.block_shape
        for i, (w, s) in enumerate(zip(weights, scales, strict=True)):
            want = (*w[:-2], -(-w[-2] // br), -(-w[-1] // bc)) if len(w) >= 2 else None
            if s != want:
                raise ValueError(f"{names[i]}: scale shape {s} is not the block grid {want} of weight {w}")
        n = len(weights)
        boxes: list[BoxRegion] = []
        for k, r in enumerate(regions):
            if not isinstance(r, QuantRegion):
                r = QuantRegion(*r)
            if r.strided:
                raise ValueError(f"region {k}: strided regions are for packing; unpacking reads packed ones")
            if r.tensor_index >= n:
                raise ValueError(f"region {k}: tensor_index {r.tensor_index} out of range for {n} tensors")
            w = weights[r.tensor_index]
            for o, ln, s, b in zip(r.offsets[-2:], r.lengths[-2:], w[-2:], (br, bc), strict=True):
                if ln and (o % b or ((o + ln) % b and o + ln != s)):
                    raise ValueError(
                        f"region {k}: box {r.offsets}+{r.lengths} of {names[r.tensor_index]} {w} does not "
                        f"cover whole {br}x{bc} blocks"
                    )
            boxes.append(BoxRegion(r.tensor_index, r.offsets, r.lengths, r.packed_offset_bytes))
            b_off = (*r.offsets[:-2], r.offsets[-2] // br, r.offsets[-1] // bc)
            b_len = r.block_lengths(self.scheme) if r.numel else (0,) * len(r.lengths)
            boxes.append(BoxRegion(n + r.tensor_index, b_off, b_len, r.scale_offset_bytes))
        self.names = names
        self.program = PackProgram(
            [*weights, *scales],
            [torch.float8_e4m3fn] * n + [self.scheme.scale_dtype] * n,
            boxes,
            device=device,
            backend=backend,
        )
        self.nbytes = self.program.nbytes

    def unpack(self, packed: torch.Tensor, weights: Sequence[torch.Tensor], scales: Sequence[torch.Tensor]) -> None:
        """Write every region's bytes and scales from ``packed`` into its boxes."""
        self.program.unpack(packed, [*weights, *scales])
