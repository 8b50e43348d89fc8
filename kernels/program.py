"""PackProgram: a validated, precomputed set of boxes packed/unpacked in one launch."""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from . import _triton_backend, delta_triton, digests
from .binding import PackBinding
from .boxes import MAX_ENTRY_BYTES, BoxRegion, Entry, entries_for, first_box_overlap
from .reference import cast_copy, copy_reference

__all__ = [
    "BACKENDS",
    "DEFAULT_NUM_WARPS",
    "DEFAULT_TILE_BYTES",
    "PackBinding",
    "PackProgram",
    "packed_nbytes",
    "warm_up",
]

BACKENDS = ("auto", "torch", "triton")
DEFAULT_TILE_BYTES = 8192
DEFAULT_NUM_WARPS = 4
_DESC_WORDS = 12
_TABLE_CACHE = 16  # resolved descriptor sets kept per program (refit reuses a few buffers)


def packed_nbytes(regions: Sequence[BoxRegion], itemsizes: Sequence[int]) -> int:
    """Bytes a packed buffer needs: the end of the last non-empty region (0 if none)."""
    end = 0
    for r in regions:
        n = r.nbytes(itemsizes[r.tensor_index])
        if n:
            end = max(end, r.packed_offset_bytes + n)
    return end


def _ptr_align_log2(ptr: int) -> int:
    """log2 of the largest power of two (<= 16) dividing an address."""
    return (math.gcd(ptr, 16) or 16).bit_length() - 1


@dataclass(frozen=True, slots=True)
class _Plan:
    """What the Triton kernel needs, built once per program and device."""

    desc: np.ndarray  # [entries, 12] int64, word 0 = tensor index until resolved
    entry_tensor: np.ndarray  # [entries] tensor index of each entry
    tile_region: torch.Tensor  # [tiles] int32 on the device: entry index of each program
    num_tiles: int
    num_entries: int


class PackProgram:
    """Pack many N-d boxes of many tensors into one flat byte buffer, and back.

    ``shapes[i]`` / ``dtypes[i]`` describe the i-th local tensor (contiguous); each
    :class:`BoxRegion` names a box of one tensor and its byte offset in the packed buffer.
    Everything is validated and precomputed here once (descriptor tensors on ``device``),
    because the same boxes are reused every refit step of an epoch.

    ``backend``: ``"triton"`` runs one kernel launch per call (compiled on CUDA; through
    Triton's interpreter on CPU, which is slow and meant for tests), ``"torch"`` one copy per
    region, ``"auto"`` picks Triton on CUDA when installed and torch otherwise.
    ``tile_bytes`` (a power of two >= 64) is the packed bytes one Triton program moves;
    ``num_warps`` its warps; ``max_entry_bytes`` (<= 1 GiB, for tests) the size above which a
    region is split into several kernel entries.

    ``packed_dtypes`` (one per tensor, default: its own dtype): the dtype a tensor's regions
    have in the packed buffer. Where it differs, :meth:`pack` casts exactly as
    ``tensor.to(packed_dtype)`` (and :meth:`unpack` casts back), so a sender's FP32 goes on
    the wire as the destination's BF16; its regions take ``numel * packed itemsize`` bytes.
    Cast regions run as torch copies (one per region) whatever the backend.

    Raises ValueError naming the region and tensor for a box out of bounds, a rank mismatch,
    or overlapping packed ranges. Boxes that overlap inside one tensor are allowed for
    :meth:`pack` but make :meth:`unpack` raise (the result would depend on write order).
    """

    def __init__(
        self,
        shapes: Sequence[Sequence[int]],
        dtypes: Sequence[torch.dtype],
        regions: Sequence[BoxRegion | tuple],
        *,
        device: torch.device | str = "cpu",
        backend: str = "auto",
        tile_bytes: int = DEFAULT_TILE_BYTES,
        num_warps: int = DEFAULT_NUM_WARPS,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
        packed_dtypes: Sequence[torch.dtype] | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not _is_pow2(tile_bytes) or tile_bytes < 64:
            raise ValueError(f"tile_bytes must be a power of two >= 64, got {tile_bytes!r}")
        if not _is_pow2(num_warps) or num_warps > 32:
            raise ValueError(f"num_warps must be a power of two <= 32, got {num_warps!r}")
        if (
            not isinstance(max_entry_bytes, int)
            or max_entry_bytes % 16
            or not 16 <= max_entry_bytes <= MAX_ENTRY_BYTES
        ):
            raise ValueError(
                f"max_entry_bytes must be a multiple of 16 in [16, {MAX_ENTRY_BYTES}], "
                f"got {max_entry_bytes!r}"
            )
        if len(shapes) != len(dtypes):
            raise ValueError(f"{len(shapes)} shapes but {len(dtypes)} dtypes")
        self.shapes: tuple[tuple[int, ...], ...] = tuple(
            _check_shape(i, s) for i, s in enumerate(shapes)
        )
        for i, dt in enumerate(dtypes):
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"dtypes[{i}] must be a torch.dtype, got {dt!r}")
        self.dtypes: tuple[torch.dtype, ...] = tuple(dtypes)
        self.itemsizes = tuple(torch.empty((), dtype=dt).element_size() for dt in self.dtypes)
        self.packed_dtypes: tuple[torch.dtype, ...] = self._check_packed_dtypes(packed_dtypes)
        # bytes per element in the packed buffer (== itemsizes unless a tensor is cast)
        self.packed_itemsizes = tuple(torch.empty((), dtype=dt).element_size() for dt in self.packed_dtypes)
        self.device = _canonical_device(torch.device(device))
        if backend == "auto":
            backend = (
                "triton" if self.device.type == "cuda" and _triton_backend.HAVE_TRITON else "torch"
            )
        self.backend = backend
        self.tile_bytes = tile_bytes
        self.num_warps = num_warps
        self.max_entry_bytes = max_entry_bytes
        self.regions: tuple[BoxRegion, ...] = tuple(
            self._check_region(i, r) for i, r in enumerate(regions)
        )
        self.nbytes = packed_nbytes(self.regions, self.packed_itemsizes)
        self._check_packed_overlap()
        self._unpack_conflict = self._find_box_overlap()
        cast = [self.packed_dtypes[r.tensor_index] != self.dtypes[r.tensor_index] for r in self.regions]
        self._cast_regions = tuple(r for r, c in zip(self.regions, cast, strict=True) if c)
        self._byte_regions = tuple(r for r, c in zip(self.regions, cast, strict=True) if not c)
        self._plan = self._build_plan() if backend == "triton" else None
        self._descs: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()

    # -- validation ---------------------------------------------------------------------
    def _check_packed_dtypes(self, packed_dtypes: Sequence[torch.dtype] | None) -> tuple[torch.dtype, ...]:
        if packed_dtypes is None:
            return self.dtypes
        packed = tuple(packed_dtypes)
        if len(packed) != len(self.dtypes):
            raise ValueError(f"{len(self.dtypes)} dtypes but {len(packed)} packed_dtypes")
        for i, dt in enumerate(packed):
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"packed_dtypes[{i}] must be a torch.dtype, got {dt!r}")
        return packed

    def _check_region(self, i: int, region: BoxRegion | tuple) -> BoxRegion:
        if not isinstance(region, BoxRegion):
            try:
                ti, offs, lens, poff = region
                region = BoxRegion(ti, tuple(offs), tuple(lens), poff)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"region {i}: {region!r} is not a BoxRegion: {exc}") from exc
        if region.tensor_index >= len(self.shapes):
            raise ValueError(
                f"region {i}: tensor_index {region.tensor_index} out of range for "
                f"{len(self.shapes)} tensors"
            )
        shape = self.shapes[region.tensor_index]
        if len(region.offsets) != len(shape):
            raise ValueError(
                f"region {i}: box of rank {len(region.offsets)} for tensor "
                f"{region.tensor_index} of shape {shape}"
            )
        for d, (o, n, s) in enumerate(zip(region.offsets, region.lengths, shape, strict=True)):
            if o + n > s:
                raise ValueError(
                    f"region {i}: box offsets {region.offsets} lengths {region.lengths} out of "
                    f"bounds of tensor {region.tensor_index} shape {shape} in dim {d} "
                    f"({o} + {n} > {s})"
                )
        return region

    def _check_packed_overlap(self) -> None:
        spans = sorted(
            (
                r.packed_offset_bytes,
                r.packed_offset_bytes + r.nbytes(self.packed_itemsizes[r.tensor_index]),
                i,
            )
            for i, r in enumerate(self.regions)
            if r.numel > 0
        )
        for (s0, e0, i0), (s1, e1, i1) in itertools.pairwise(spans):
            if s1 < e0:
                raise ValueError(
                    f"regions {i0} (tensor {self.regions[i0].tensor_index}) and {i1} (tensor "
                    f"{self.regions[i1].tensor_index}) overlap in the packed buffer: "
                    f"bytes [{s0}, {e0}) and [{s1}, {e1})"
                )

    def _find_box_overlap(self) -> str | None:
        by_tensor: dict[int, list[tuple[int, BoxRegion]]] = {}
        for i, r in enumerate(self.regions):
            if r.numel > 0:
                by_tensor.setdefault(r.tensor_index, []).append((i, r))
        for t, items in sorted(by_tensor.items()):
            pair = first_box_overlap(items)
            if pair is not None:
                a, b = (self.regions[k] for k in pair)
                return (
                    f"regions {pair[0]} and {pair[1]} overlap inside tensor {t}: boxes "
                    f"{a.offsets}+{a.lengths} and {b.offsets}+{b.lengths}"
                )
        return None

    def _check_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        if len(tensors) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} tensors, got {len(tensors)}")
        dev = self.device.index if self.device.type == "cuda" else -1
        for i, t in enumerate(tensors):
            # One cheap combined test per tensor (called for hundreds of tensors per pack);
            # the precise message is worked out only on failure.
            if (
                t.shape != self.shapes[i]
                or t.dtype != self.dtypes[i]
                or not t.is_contiguous()
                or t.get_device() != dev
            ):
                self._tensor_error(i, t)

    def _tensor_error(self, i: int, t: torch.Tensor) -> None:
        if tuple(t.shape) != self.shapes[i]:
            raise ValueError(f"tensor {i}: shape {tuple(t.shape)} != program's {self.shapes[i]}")
        if t.dtype != self.dtypes[i]:
            raise ValueError(f"tensor {i}: dtype {t.dtype} != program's {self.dtypes[i]}")
        if not t.is_contiguous():
            raise ValueError(f"tensor {i}: not contiguous (strides {t.stride()})")
        raise ValueError(f"tensor {i}: on {t.device}, program is on {self.device}")

    def _check_buffer(self, buf: torch.Tensor, name: str) -> None:
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous 1-D torch.uint8 tensor, got dtype {buf.dtype} "
                f"shape {tuple(buf.shape)} strides {buf.stride()}"
            )
        if buf.numel() < self.nbytes:
            raise ValueError(f"{name} has {buf.numel()} bytes, the program needs {self.nbytes}")
        if buf.device != self.device:
            raise ValueError(f"{name} is on {buf.device}, program is on {self.device}")

    # -- Triton plan --------------------------------------------------------------------
    def _build_plan(self) -> _Plan:
        entries: list[Entry] = []
        for r in self._byte_regions:  # cast regions are torch copies
            if r.numel > 0:
                entries.extend(
                    entries_for(
                        r,
                        self.shapes[r.tensor_index],
                        self.itemsizes[r.tensor_index],
                        self.max_entry_bytes,
                    )
                )
        desc = np.zeros((max(len(entries), 1), _DESC_WORDS), dtype=np.int64)
        tiles = np.zeros(len(entries), dtype=np.int64)
        first = 0
        for k, e in enumerate(entries):
            (_n0, s0), (n1, s1), (n2, s2) = e.dims
            ntiles = -(-e.nbytes // self.tile_bytes)
            desc[k] = (
                e.tensor_index,
                e.tensor_offset,
                e.packed_offset,
                e.row_bytes,
                n1,
                n2,
                s0,
                s1,
                s2,
                e.width_log2,
                first,
                e.nbytes,
            )
            tiles[k] = ntiles
            first += ntiles
        if first >= 2**31:
            raise ValueError(f"{first} tiles exceed the launch grid; raise tile_bytes")
        tile_region = np.repeat(np.arange(len(entries), dtype=np.int32), tiles)
        return _Plan(
            desc=desc,
            entry_tensor=desc[: len(entries), 0].copy(),
            tile_region=torch.from_numpy(tile_region).to(self.device),
            num_tiles=int(first),
            num_entries=len(entries),
        )

    def _resolved(self, tensors: Sequence[torch.Tensor], buf: torch.Tensor) -> torch.Tensor:
        """Descriptors with these addresses folded in, cached by address (refit reuses the
        same buffers, so steady state is a dictionary hit and no host-to-device copy)."""
        plan = self._plan
        assert plan is not None
        bptr = buf.data_ptr()
        key = (bptr, *(t.data_ptr() for t in tensors))
        desc = self._descs.get(key)
        if desc is not None:
            self._descs.move_to_end(key)
            return desc
        ptrs = np.asarray(key[1:], dtype=np.uint64).view(np.int64)
        align = np.asarray([_ptr_align_log2(p) for p in key[1:]], dtype=np.int64)
        host = plan.desc.copy()
        n = len(plan.entry_tensor)
        if n:
            ti = plan.entry_tensor
            host[:n, 0] = ptrs[ti] - np.int64(np.uint64(bptr).view(np.int64))
            cap = np.minimum(align[ti], _ptr_align_log2(bptr))
            host[:n, 9] = np.minimum(host[:n, 9], cap)
        desc = torch.from_numpy(host).to(self.device)
        self._descs[key] = desc
        if len(self._descs) > _TABLE_CACHE:
            self._descs.popitem(last=False)
        return desc

    def _launch(self, buf: torch.Tensor, desc: torch.Tensor, pack: bool) -> None:
        """One Triton launch over ``buf`` with resolved descriptors ``desc``."""
        plan = self._plan
        assert plan is not None
        _triton_backend.launch(
            buf=buf,
            desc=desc,
            tile_region=plan.tile_region,
            num_tiles=plan.num_tiles,
            pack=pack,
            tile_bytes=self.tile_bytes,
            num_warps=self.num_warps,
        )

    def _copy(self, tensors: Sequence[torch.Tensor], buf: torch.Tensor, pack: bool) -> None:
        """Check the arguments, then pack ``tensors`` into ``buf`` (``pack``) or unpack."""
        self._check_tensors(tensors)
        self._check_buffer(buf, "out" if pack else "packed")
        if self._plan is None:
            copy_reference(self._byte_regions, tensors, buf, pack=pack)
        elif self._plan.num_tiles:
            self._launch(buf, self._resolved(tensors, buf), pack)
        if self._cast_regions:
            cast_copy(self._cast_regions, tensors, buf, self.packed_dtypes, pack=pack)

    # -- public -------------------------------------------------------------------------
    @property
    def num_launch_programs(self) -> int:
        """Programs one Triton launch runs (0 for the torch backend or an empty program)."""
        return self._plan.num_tiles if self._plan is not None else 0

    def pack(self, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Copy every region of ``tensors`` into the flat uint8 buffer ``out``; returns ``out``.

        Bytes of ``out`` outside the regions are left as they were.
        """
        self._copy(tensors, out, pack=True)
        return out

    def unpack(self, packed: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy each region's bytes from ``packed`` into its box; nothing else is written."""
        if self._unpack_conflict is not None:
            raise ValueError(f"cannot unpack: {self._unpack_conflict}")
        self._copy(tensors, packed, pack=False)

    def bind(
        self, tensors: Sequence[torch.Tensor], buf: torch.Tensor, *, cuda_graph: bool = False
    ) -> PackBinding:
        """Validate ``tensors`` and ``buf`` once; the binding's calls then only launch.

        ``cuda_graph=True`` (CUDA, Triton backend) captures each direction's launch into a
        CUDA graph on first use and replays it afterwards, which cuts the host-side launch
        cost (it dominates for buckets of a few MiB). Replays run on the current stream.
        """
        self._check_tensors(tensors)
        self._check_buffer(buf, "buf")
        if cuda_graph and (self.device.type != "cuda" or self._plan is None):
            raise ValueError(
                f"cuda_graph needs a CUDA device and the triton backend, program is on "
                f"{self.device} with backend {self.backend!r}"
            )
        return PackBinding(self, tuple(tensors), buf, cuda_graph)

    def __repr__(self) -> str:
        return (
            f"PackProgram(tensors={len(self.shapes)}, regions={len(self.regions)}, "
            f"nbytes={self.nbytes}, backend={self.backend!r}, device={str(self.device)!r})"
        )


def _canonical_device(device: torch.device) -> torch.device:
    """'cuda' means the current CUDA device: tensors report 'cuda:N', so compare like that."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _is_pow2(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0 and x & (x - 1) == 0


def _check_shape(i: int, shape: Sequence[int]) -> tuple[int, ...]:
    try:
        s = tuple(shape)
    except TypeError as exc:
        raise ValueError(f"shapes[{i}] must be a sequence of ints, got {shape!r}") from exc
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s):
        raise ValueError(f"shapes[{i}] must hold ints >= 0, got {s!r}")
    return s


def warm_up(device: torch.device | str, backend: str = "auto", *, deltas: bool = False) -> None:
    """Compile (or load from Triton's cache) the pack and unpack kernels on ``device`` and
    run each once, so that a process's first refit does not pay for it: a rank that joins a
    running job would otherwise pay it in its first transfer. The kernel has two variants
    (pack, unpack) for every box, dtype and alignment, so one tiny box warms them all.
    So is the bucket digest's (``kernels.digests``). ``deltas``: the delta kernels too
    (:func:`delta_triton.warm_up`)."""
    device = _canonical_device(torch.device(device))
    if deltas:
        delta_triton.warm_up(device)
    t = torch.zeros(4, 64, dtype=torch.bfloat16, device=device)
    program = PackProgram([t.shape], [t.dtype], [BoxRegion(0, (0, 0), (4, 32), 0)], device=device,
                          backend=backend)
    buf = torch.empty(program.nbytes, dtype=torch.uint8, device=device)
    program.pack([t], buf)
    program.unpack(buf, [t])
    if digests.usable(device):  # both variants: boxes on whole words, and anywhere
        digests.BoxDigests([(0, 9), (9, 8)], device)(buf[:17])
        digests.BoxDigests([(0, 16)], device)(buf[:16])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
