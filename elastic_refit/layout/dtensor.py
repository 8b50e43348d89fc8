"""DTensor-style constructors: a device mesh plus one placement per mesh axis.

``Shard(dim)`` follows ``torch.chunk`` semantics (chunks of ``ceil(n / k)``, trailing shards
may be short or empty) applied in mesh-axis order, exactly as
``torch.distributed.tensor._utils._compute_local_shape_and_global_offset`` does.

``StridedShard(dim, split_factor)`` is torch's ``_StridedShard`` (what FSDP2 puts on a dim
that TP shards too): the rank's current local extent of ``dim`` is chunked into
``split_factor`` parts, each part is chunked over the mesh axis, and the rank keeps its chunk
of every part, concatenated. Its local data is in general several global boxes, so
``shard_intervals`` / ``shard_pieces`` describe a shard as intervals per dim and
``shard_boxes`` (one box per mesh position) refuses it.

``from_dtensors`` turns real torch DTensors (and plain tensors) into a layout; every rank
builds the identical layout of its whole side from its own metadata, with no communication.
A quantized inference model describes its destination formats too: ``formats_from_tensors``
recognises FP8 weights by their scale siblings (``weight_scale_inv``, ``weight_scale``), and
``from_dtensors(..., formats=...)`` declares those weights in their logical dtype (BF16) and
leaves the scale siblings out of the layout (the format implies them).
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from elastic_refit._validate import is_integer
from elastic_refit.layout.core import LayoutBuilder
from elastic_refit.layout.formats import MX_BLOCK, DestinationFormat, TensorFormats

if TYPE_CHECKING:  # torch is imported only inside the DTensor interop functions
    import torch

__all__ = [
    "Placement",
    "Replicate",
    "Shard",
    "ShardPieces",
    "StridedShard",
    "add_sharded_tensor",
    "formats_from_tensors",
    "from_dtensors",
    "local_shards",
    "parse_placement",
    "shard_boxes",
    "shard_intervals",
    "shard_pieces",
]


@dataclass(frozen=True, slots=True)
class Shard:
    """Split tensor dim ``dim`` across one mesh axis (torch.chunk semantics)."""

    dim: int

    def __post_init__(self) -> None:
        if not is_integer(self.dim) or self.dim < 0:
            raise ValueError(f"Shard dim must be an integer >= 0, got {self.dim!r}")

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class StridedShard:
    """torch's ``_StridedShard(dim, split_factor=k)``: a right-to-left shard of ``dim``.

    Along this mesh axis the rank's current extent of ``dim`` is chunked into
    ``split_factor`` parts (torch.chunk), each part is chunked over the axis, and the rank
    holds its chunk of every part, in part order. ``split_factor=1`` is ``Shard(dim)``.
    """

    dim: int
    split_factor: int

    def __post_init__(self) -> None:
        if not is_integer(self.dim) or self.dim < 0:
            raise ValueError(f"StridedShard dim must be an integer >= 0, got {self.dim!r}")
        if not is_integer(self.split_factor) or self.split_factor < 1:
            raise ValueError(
                f"StridedShard split_factor must be an integer >= 1, got {self.split_factor!r}"
            )

    def __str__(self) -> str:
        return f"_S({self.dim}, {self.split_factor})"  # torch's own spelling


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every rank along the mesh axis holds the same data."""

    def __str__(self) -> str:
        return "R"


Placement = Shard | StridedShard | Replicate

_SHARD_RE = re.compile(r"^\s*(?:S|Shard)\s*\(\s*(?:dim\s*=\s*)?(\d+)\s*\)\s*$")
# "_S(0, 2)" (torch's str), "StridedShard(0, 2)", "_StridedShard(dim=0, sf=2)" (torch's repr)
_STRIDED_RE = re.compile(
    r"^\s*(?:_S|_?StridedShard)\s*\(\s*(?:dim\s*=\s*)?(\d+)\s*,\s*"
    r"(?:(?:split_factor|sf)\s*=\s*)?(\d+)\s*\)\s*$"
)
_REPLICATE_RE = re.compile(r"^\s*(?:R|Replicate(?:\(\s*\))?)\s*$")
_PLACEMENT_HELP = 'use "R" or "S(dim)" (or "_S(dim, split_factor)" for a strided shard)'


def parse_placement(text: object) -> Placement:
    """Parse ``"R"``, ``"Replicate()"``, ``"S(0)"``, ``"Shard(0)"``, or a strided shard
    ``"_S(0, 2)"`` / ``"StridedShard(0, 2)"`` / ``"_StridedShard(dim=0, sf=2)"``."""
    if isinstance(text, Shard | StridedShard | Replicate):
        return text
    if not isinstance(text, str):
        raise ValueError(f"unknown placement {text!r}: {_PLACEMENT_HELP}")
    if _REPLICATE_RE.match(text):
        return Replicate()
    m = _SHARD_RE.match(text)
    if m:
        return Shard(int(m.group(1)))
    m = _STRIDED_RE.match(text)
    if m:
        return StridedShard(int(m.group(1)), int(m.group(2)))
    raise ValueError(f"unknown placement {text!r}: {_PLACEMENT_HELP}")


def _check_placements(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> tuple[tuple[int, ...], tuple[int, ...], np.ndarray]:
    """Normalised ``(shape, mesh_shape, coords)``; ``coords`` is ``[positions, axes]``, row-major."""
    shape = tuple(int(s) for s in shape)
    mesh_shape = tuple(int(m) for m in mesh_shape)
    if len(placements) != len(mesh_shape):
        raise ValueError(
            f"{len(placements)} placements for a mesh with {len(mesh_shape)} axes "
            f"(mesh shape {mesh_shape})"
        )
    for axis, placement in enumerate(placements):
        if not isinstance(placement, Replicate) and placement.dim >= len(shape):
            raise ValueError(f"placement {placement} on mesh axis {axis} is out of range for shape {shape}")
    num = int(np.prod(mesh_shape)) if mesh_shape else 1
    coords = (np.stack(np.unravel_index(np.arange(num), mesh_shape), axis=1) if mesh_shape
              else np.zeros((1, 0), np.int64))
    return shape, mesh_shape, coords.astype(np.int64)


def shard_boxes(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> tuple[np.ndarray, np.ndarray]:
    """Global box of every mesh position, in row-major mesh order.

    Returns ``(offsets, lengths)``, each ``[prod(mesh_shape), len(shape)]``. Non-empty shards
    match torch exactly. An empty shard's offset is the end of the shard it was cut from
    (torch reports the dim's global size when several mesh axes split one dim); empty
    pieces are dropped from layouts, so plans never see the difference.

    Only ``Shard`` and ``Replicate``: a strided shard is not one box per position; use
    ``shard_pieces`` (or ``shard_intervals``) for it.
    """
    strided = [str(p) for p in placements if isinstance(p, StridedShard)]
    if strided:
        raise ValueError(
            f"shard_boxes gives one box per mesh position, but strided placement {strided[0]} "
            f"splits a shard into several boxes: use shard_pieces (or shard_intervals) instead"
        )
    shape, mesh_shape, coords = _check_placements(shape, mesh_shape, placements)
    num = coords.shape[0]
    offsets = np.zeros((num, len(shape)), dtype=np.int64)
    lengths = np.tile(np.asarray(shape, dtype=np.int64), (num, 1))
    for axis, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        dim = placement.dim
        k = mesh_shape[axis]
        size = lengths[:, dim]
        chunk = -(-size // k)  # ceil
        start = chunk * coords[:, axis]
        local = np.clip(np.minimum(size, start + chunk) - start, 0, None)
        offsets[:, dim] += np.where(size < start, size, start)
        lengths[:, dim] = local
    return offsets, lengths


def _chunk(start: np.ndarray, size: np.ndarray, num_chunks: int, index: np.ndarray | int):
    """``[lo, hi)`` of chunk ``index`` of ``torch.chunk`` over ``[start, start + size)``
    (missing trailing chunks are empty, as torch's ``fill_empty_tensor_to_shards`` makes them)."""
    step = (size + num_chunks - 1) // num_chunks
    lo = start + np.minimum(step * index, size)
    hi = start + np.minimum(step * (index + 1), size)
    return lo, hi


def _merge_intervals(g: np.ndarray, n: np.ndarray, s: np.ndarray):
    """Drop empty intervals and join neighbours that are adjacent in the global tensor.

    Rows hold one position's intervals in local order; non-empty ones tile the local extent,
    so two neighbours adjacent globally are one interval. Joining makes a strided shard that
    happens to be contiguous (``split_factor=1``, a size-1 axis) the very piece ``Shard``
    gives. Returns arrays of width max(1, most intervals of any row), padded with length 0.
    """
    order = np.argsort(n == 0, axis=1, kind="stable")  # non-empty first, order kept
    g, n, s = (np.take_along_axis(a, order, axis=1) for a in (g, n, s))
    valid = n > 0
    joins = np.zeros_like(valid)
    joins[:, 1:] = valid[:, 1:] & valid[:, :-1] & (g[:, :-1] + n[:, :-1] == g[:, 1:])
    starts = valid & ~joins
    segment = np.cumsum(starts, axis=1) - 1
    width = max(1, int(starts.sum(axis=1).max(initial=0)))
    out_g, out_n, out_s = (np.zeros((g.shape[0], width), dtype=np.int64) for _ in range(3))
    rows, cols = np.nonzero(starts)
    out_g[rows, segment[rows, cols]] = g[rows, cols]
    out_s[rows, segment[rows, cols]] = s[rows, cols]
    rows, cols = np.nonzero(valid)
    np.add.at(out_n, (rows, segment[rows, cols]), n[rows, cols])
    return out_g, out_n, out_s


def shard_intervals(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]:
    """Per tensor dim, every mesh position's intervals ``(global_start, length, local_start)``.

    Simulates the placements in mesh-axis order on each position's local index space, as
    torch does (``Shard``: one ``torch.chunk``; ``StridedShard``: chunk into
    ``split_factor`` parts, chunk each part, keep this position's chunk of every part).
    Returns one ``(global_start, length, local_start)`` triple per dim, each
    ``[prod(mesh_shape), m]``: a row holds one position's intervals in local order, with
    entries of length 0 as padding (rows may have fewer intervals than others). A position's
    local extent of a dim is the sum of its lengths; its local data is the product of its
    intervals over the dims, each placed at its local starts.
    """
    shape, mesh_shape, coords = _check_placements(shape, mesh_shape, placements)
    num = coords.shape[0]
    dims = [
        (np.zeros((num, 1), np.int64), np.full((num, 1), size, np.int64), np.zeros((num, 1), np.int64))
        for size in shape
    ]
    for axis, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        g, n, s = dims[placement.dim]
        k = mesh_shape[axis]
        c = coords[:, axis : axis + 1]
        total = n.sum(axis=1, keepdims=True)  # the position's current local extent
        zero = np.zeros_like(total)
        if isinstance(placement, StridedShard):
            ranges = []
            for part in range(placement.split_factor):
                p_lo, p_hi = _chunk(zero, total, placement.split_factor, part)
                ranges.append(_chunk(p_lo, p_hi - p_lo, k, c))
        else:
            ranges = [_chunk(zero, total, k, c)]
        new_g, new_n, new_s = [], [], []
        base = zero  # where this range starts in the new local extent
        for lo, hi in ranges:
            # intersect every current interval [s, s + n) (local) with [lo, hi)
            start = np.maximum(s, lo)
            length = np.clip(np.minimum(s + n, hi) - start, 0, None)
            new_g.append(np.where(length > 0, g + start - s, 0))
            new_n.append(length)
            new_s.append(np.where(length > 0, base + start - lo, 0))
            base = base + (hi - lo)
        new_g, new_n, new_s = (np.concatenate(a, axis=1) for a in (new_g, new_n, new_s))
        # Cutting with one range (Shard) only shrinks intervals: no two become adjacent, so
        # only a strided cut needs joining (empty ones are dropped later, in shard_pieces).
        dims[placement.dim] = (_merge_intervals(new_g, new_n, new_s) if len(ranges) > 1
                               else (new_g, new_n, new_s))
    return tuple(dims)


@dataclass(frozen=True, slots=True, eq=False)
class ShardPieces:
    """The non-empty pieces of one sharded tensor over a mesh (see ``shard_pieces``).

    ``position[i]`` is the row-major mesh position holding piece ``i``: global box
    ``offsets[i] + lengths[i]`` lives at ``local_offsets[i]`` (same extents) in that
    position's local shard, of shape ``local_shape[position[i]]``.
    """

    position: np.ndarray  # int64[P]
    offsets: np.ndarray  # int64[P, D]
    lengths: np.ndarray  # int64[P, D]
    local_offsets: np.ndarray  # int64[P, D]
    local_shape: np.ndarray  # int64[positions, D]


def shard_pieces(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> ShardPieces:
    """Every mesh position's local shard as pieces: one per combination of its intervals.

    Handles every placement (``Shard``, ``StridedShard``, ``Replicate``); a position whose
    shard is one box gets one piece. Empty pieces are left out; pieces are in position order.
    """
    if not any(isinstance(p, StridedShard) for p in placements):
        # One box per position: the vectorised shard_boxes is ~30x faster than intervals.
        offsets, lengths = shard_boxes(shape, mesh_shape, placements)
        keep = np.flatnonzero(np.all(lengths > 0, axis=1))
        return ShardPieces(keep, offsets[keep], lengths[keep], np.zeros_like(offsets[keep]), lengths)
    intervals = shard_intervals(shape, mesh_shape, placements)
    ndim = len(intervals)
    num = int(np.prod([int(m) for m in mesh_shape])) if len(mesh_shape) else 1
    local_shape = (np.stack([n.sum(axis=1) for _, n, _ in intervals], axis=1) if ndim
                   else np.zeros((num, 0), np.int64))
    chunks: list[tuple[np.ndarray, ...]] = []
    for combo in itertools.product(*(range(g.shape[1]) for g, _, _ in intervals)):
        off = np.zeros((num, ndim), np.int64)
        ln = np.zeros((num, ndim), np.int64)
        loff = np.zeros((num, ndim), np.int64)
        for d, i in enumerate(combo):
            g, n, s = intervals[d]
            off[:, d], ln[:, d], loff[:, d] = g[:, i], n[:, i], s[:, i]
        keep = np.all(ln > 0, axis=1)
        chunks.append((np.flatnonzero(keep), off[keep], ln[keep], loff[keep]))
    position = np.concatenate([c[0] for c in chunks])
    order = np.argsort(position, kind="stable")
    offsets, lengths, local_offsets = (np.concatenate([c[j] for c in chunks])[order] for j in (1, 2, 3))
    return ShardPieces(position[order], offsets, lengths, local_offsets, local_shape)


@functools.lru_cache(maxsize=512)
def _frozen_shard_pieces(shape: tuple[int, ...], mesh_shape: tuple[int, ...],
                         placements: tuple[Placement, ...]) -> ShardPieces:
    """``shard_pieces`` memoised, arrays read-only: a model repeats a few (shape, mesh,
    placements) triples over all its layers, and a strided one costs ~10 ms at 4096 ranks."""
    pieces = shard_pieces(shape, mesh_shape, placements)
    for name in ShardPieces.__slots__:
        getattr(pieces, name).setflags(write=False)
    return pieces


def add_sharded_tensor(
    builder: LayoutBuilder,
    name: str,
    shape: Sequence[int],
    dtype: object,
    mesh: np.ndarray | Sequence,
    placements: Sequence[Placement | str],
    buffer: str | None = None,
) -> None:
    """Add one logical tensor laid out DTensor-style; each rank's shard is its own buffer.

    ``mesh`` is an N-d array of rank ids. The buffer is named ``buffer`` (default: the
    tensor name) and holds the rank's local shard contiguously (a strided shard's several
    global boxes sit side by side in it, in torch's order).
    """
    mesh_arr = np.asarray(mesh)
    if mesh_arr.size == 0 or not np.issubdtype(mesh_arr.dtype, np.integer):
        raise ValueError(f"tensor {name!r}: mesh must be a non-empty nested list of rank ids, got {mesh!r}")
    flat = mesh_arr.reshape(-1).astype(np.int64)
    if len(np.unique(flat)) != flat.size:
        raise ValueError(f"tensor {name!r}: mesh lists a rank twice: {mesh_arr.tolist()}")
    if (flat < 0).any():
        raise ValueError(f"tensor {name!r}: mesh ranks must be >= 0: {mesh_arr.tolist()}")
    parsed = [parse_placement(p) for p in placements]
    t = builder.tensor(name, shape, dtype)
    pieces = _frozen_shard_pieces(tuple(int(n) for n in shape), tuple(mesh_arr.shape), tuple(parsed))
    buffer_ids = builder.buffers(buffer or name, flat, pieces.local_shape, dtype)
    builder.pieces(t, buffer_ids[pieces.position], pieces.offsets, pieces.lengths, pieces.local_offsets)


# ---- torch interop (torch is imported only inside these functions) --------------------------


def _named_tensors(named: object) -> list[tuple[str, object]]:
    """``(name, tensor)`` pairs of an ``nn.Module`` (its parameters), a dict or a list of pairs."""
    import torch

    if isinstance(named, torch.nn.Module):
        return list(named.named_parameters())
    if isinstance(named, Mapping):
        return list(named.items())
    if isinstance(named, str | bytes) or not isinstance(named, Sequence | Iterator):
        raise ValueError(
            f"expected an nn.Module, a dict or a list of (name, tensor) pairs, got {type(named).__name__}"
        )
    items = list(named)
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"expected (name, tensor) pairs, got {item!r:.80}")
    return [(str(n), t) for n, t in items]


def _our_placement(name: str, placement: object, ndim: int) -> Placement:
    """Our placement for a torch placement; anything else is one ValueError naming both."""
    from torch.distributed.tensor.placement_types import Partial, _StridedShard
    from torch.distributed.tensor.placement_types import Replicate as TorchReplicate
    from torch.distributed.tensor.placement_types import Shard as TorchShard

    # Exact types: in some torch versions _StridedShard subclasses Shard, and other Shard /
    # Partial subclasses (padded or masked variants) have layouts of their own.
    if type(placement) in (_StridedShard, TorchShard):
        dim = int(placement.dim)
        dim = dim + ndim if dim < 0 else dim  # torch accepts Shard(-1)
        if not 0 <= dim < ndim:
            raise ValueError(f"tensor {name!r}: placement {placement} is out of range for a {ndim}-d tensor")
        if type(placement) is _StridedShard:
            return StridedShard(dim, int(placement.split_factor))
        return Shard(dim)
    if type(placement) is TorchReplicate:
        return Replicate()
    hint = ("; a Partial DTensor holds unreduced values: redistribute() it to Shard or Replicate first"
            if isinstance(placement, Partial) else "")
    raise ValueError(
        f"tensor {name!r}: placement {placement} is not supported (only Shard and Replicate); "
        f"_StridedShard counts as Shard{hint}"
    )


def _full_mesh(name: str, device_mesh: object) -> np.ndarray:
    """Every copy of ``device_mesh`` in its root mesh: ``[copies, *device_mesh.shape]`` rank ids.

    A sub-mesh (``root["dp"]``, a flattened ``root["dp", "cp"]._flatten()``, a concatenation)
    is a strided view into the root's rank list; ``DeviceMesh.mesh`` shows only the copy
    holding the calling rank ([0, 2] on rank 0, [1, 3] on rank 1), but the mesh's layout
    remapped onto the whole rank list enumerates all copies in one order that does not depend
    on the caller. The copies hold the same data (the root axes the sub-mesh does not cover
    replicate it), so the result is the DTensor lifted onto its root mesh with ``Replicate``
    on the extra axis, identical on every rank.
    """
    shape = tuple(int(s) for s in device_mesh.shape)
    layout = getattr(device_mesh, "_layout", None)
    rank_map = getattr(device_mesh, "_rank_map", None)
    if layout is not None and rank_map is not None and hasattr(layout, "remap_to_tensor"):
        full = layout.remap_to_tensor(rank_map).cpu().numpy().astype(np.int64)
    else:  # torch without mesh layouts: only a root mesh lists all its ranks by itself
        root = device_mesh._get_root_mesh() if hasattr(device_mesh, "_get_root_mesh") else device_mesh
        if root is not device_mesh and root != device_mesh:
            raise ValueError(
                f"tensor {name!r}: its mesh {device_mesh} is a sub-mesh of {root}, and this torch "
                f"has no DeviceMesh._layout to enumerate its copies"
            )
        full = device_mesh.mesh.cpu().numpy().astype(np.int64)[None]
    if full.shape[1:] != shape:
        raise ValueError(f"tensor {name!r}: mesh copies of shape {full.shape[1:]} for a mesh of shape {shape}")
    return full


def _rank_renamer(rank_map: Mapping[int, int] | None, rank_offset: int) -> Callable[[str, np.ndarray], np.ndarray]:
    """A function mapping an array of torch global ranks to layout ranks (ValueError on gaps)."""
    if not is_integer(rank_offset, numpy=True):
        raise ValueError(f"rank_offset must be an integer, got {rank_offset!r}")
    rank_offset = int(rank_offset)
    if rank_map is None:
        return lambda name, ranks: ranks + rank_offset
    if rank_offset:
        raise ValueError(f"give rank_map or rank_offset, not both (rank_offset={rank_offset})")
    if not isinstance(rank_map, Mapping):
        raise ValueError(f"rank_map must map torch rank -> layout rank, got {type(rank_map).__name__}")
    for k, v in rank_map.items():
        if not (is_integer(k, numpy=True) and is_integer(v, numpy=True) and k >= 0 and v >= 0):
            raise ValueError(f"rank_map entries must be integers >= 0, got {k!r}: {v!r}")
    taken: dict[int, int] = {}
    for k, v in rank_map.items():
        if int(v) in taken:
            torch_ranks = sorted([taken[int(v)], int(k)])
            raise ValueError(f"rank_map sends torch ranks {torch_ranks} to the same layout rank {int(v)}")
        taken[int(v)] = int(k)
    lookup = np.full(max((int(k) for k in rank_map), default=-1) + 2, -1, dtype=np.int64)  # last: "absent"
    for k, v in rank_map.items():
        lookup[int(k)] = int(v)

    def rename(name: str, ranks: np.ndarray) -> np.ndarray:
        out = lookup[np.where(ranks < lookup.size, ranks, lookup.size - 1)]
        if (out < 0).any():
            missing = sorted(set(ranks[out < 0].tolist()))
            raise ValueError(f"tensor {name!r}: rank_map has no entry for torch rank(s) {missing}")
        return out

    return rename


def _logical_namer(names: Mapping[str, str] | Callable[[str], str] | None) -> Callable[[str], str]:
    if names is None:
        return lambda name: name
    if isinstance(names, Mapping):
        def lookup(name: str) -> str:
            if name not in names:
                raise ValueError(f"names has no entry for parameter {name!r} (use a callable for partial renames)")
            return names[name]
        return lookup
    if callable(names):
        return names
    raise ValueError(f"names must be a mapping or a callable, got {type(names).__name__}")


def from_dtensors(
    named: object,
    *,
    names: Mapping[str, str] | Callable[[str], str] | None = None,
    plain_ranks: Sequence[int] | None = None,
    rank_map: Mapping[int, int] | None = None,
    rank_offset: int = 0,
    formats: TensorFormats | None = None,
) -> LayoutBuilder:
    """A builder holding the layout of one side's ``torch.distributed.tensor.DTensor`` objects.

    ``named`` is an ``nn.Module`` (its ``named_parameters()``), a dict or a list of
    ``(name, tensor)`` pairs. Each entry becomes logical tensor ``names(name)`` (a mapping
    that must cover every name, or a callable; default: the name itself) held in buffer
    ``name`` (what ``local_shards`` returns under that name) on every rank that holds a shard.

    Placements ``Shard``, ``_StridedShard`` (FSDP2 + TP) and ``Replicate`` are supported;
    ``Partial`` or any other placement raises ``ValueError`` naming the tensor. A DTensor on
    a sub-mesh (FSDP2's dp mesh inside a dp x tp world) is lifted onto its root mesh with
    ``Replicate`` over the root axes the sub-mesh does not cover, so every rank builds the
    same layout (same ``Layout.fingerprint``) from its own metadata.

    Plain tensors are replicated over ``plain_ranks`` (torch global ranks; default: every
    rank of the meshes of the DTensors given; ``ValueError`` if there are none). Ranks are
    renamed to layout ranks by ``rank_map`` (torch global rank -> layout rank, every rank
    must be covered) or shifted by ``rank_offset``, meshes and ``plain_ranks`` alike.

    ``formats`` (logical names, e.g. from :func:`formats_from_tensors`): each quantized
    tensor is declared as ``bfloat16`` (its logical dtype; the local parameter holds its FP8
    bytes) and its scale sibling (parameter name + the format's ``scale_suffix``) is left
    out of the layout.
    """
    import torch.distributed.tensor  # noqa: F401  (a missing torch fails before the arguments are checked)

    rename = _rank_renamer(rank_map, rank_offset)
    logical = _logical_namer(names)
    builder = LayoutBuilder()
    formats = formats if formats is not None else TensorFormats()
    entries = _named_tensors(named)
    scale_siblings = _scale_siblings(entries, formats, logical)
    plain, mesh_ranks = _declare_dtensors(builder, entries, scale_siblings, logical, rename, formats)
    if plain:
        ranks = _plain_ranks(plain, plain_ranks, mesh_ranks)
        for name, tensor_name, tensor in plain:
            add_sharded_tensor(builder, tensor_name, tuple(tensor.shape), _declared_dtype(formats, tensor_name, tensor),
                               rename(name, ranks), [Replicate()], buffer=name)
    return builder


def _scale_siblings(entries: list[tuple[str, object]], formats: TensorFormats,
                    logical: Callable[[str], str]) -> set[str]:
    """Parameter names of the scales of quantized tensors: the format implies them, so the
    layout leaves them out."""
    present = {name for name, _ in entries}
    scale_siblings: set[str] = set()
    for name, _ in entries:
        for suffix in ("_scale_inv", "_scale"):
            if formats and name + suffix in present:
                try:
                    fmt = formats.of(logical(name))
                except ValueError:  # a scale's own name need not be in the names mapping
                    continue
                if fmt.quantized and fmt.scale_suffix == suffix:
                    scale_siblings.add(name + suffix)
    return scale_siblings


def _declared_dtype(formats: TensorFormats, tensor_name: str, tensor: torch.Tensor) -> object:
    """A quantized tensor is declared in its logical dtype; its local bytes are FP8."""
    return "bfloat16" if tensor_name in formats else tensor.dtype


def _claim_logical_name(name: str, tensor_name: object, seen_logical: dict[str, str]) -> None:
    """Check that ``names`` gave parameter ``name`` a usable logical name no other parameter has."""
    if not isinstance(tensor_name, str) or not tensor_name:
        raise ValueError(f"names gave {tensor_name!r} for parameter {name!r}; expected a non-empty string")
    if tensor_name in seen_logical:
        raise ValueError(
            f"parameters {seen_logical[tensor_name]!r} and {name!r} both map to logical tensor {tensor_name!r}"
        )
    seen_logical[tensor_name] = name


def _declare_dtensors(
    builder: LayoutBuilder, entries: list[tuple[str, object]], skip: set[str], logical: Callable[[str], str],
    rename: Callable[[str, np.ndarray], np.ndarray], formats: TensorFormats,
) -> tuple[list[tuple[str, str, torch.Tensor]], set[int]]:
    """Declare every DTensor of ``entries`` (but ``skip``), lifted onto its root mesh; returns
    the plain tensors, ``(name, logical name, tensor)`` in order, and the torch ranks of the
    meshes seen (the default holders of the plain tensors)."""
    import torch
    from torch.distributed.tensor import DTensor

    seen_logical: dict[str, str] = {}
    plain: list[tuple[str, str, torch.Tensor]] = []
    mesh_ranks: set[int] = set()
    for name, tensor in entries:
        if name in skip:
            continue
        tensor_name = logical(name)
        _claim_logical_name(name, tensor_name, seen_logical)
        if not isinstance(tensor, DTensor):
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
            plain.append((name, tensor_name, tensor))
            continue
        placements = [_our_placement(name, p, tensor.ndim) for p in tensor.placements]
        full = _full_mesh(name, tensor.device_mesh)
        mesh_ranks.update(full.reshape(-1).tolist())
        add_sharded_tensor(
            builder, tensor_name, tuple(tensor.shape), _declared_dtype(formats, tensor_name, tensor),
            rename(name, full), [Replicate(), *placements], buffer=name,
        )
    return plain, mesh_ranks


def _plain_ranks(plain: list[tuple[str, str, torch.Tensor]], plain_ranks: Sequence[int] | None,
                 mesh_ranks: set[int]) -> np.ndarray:
    """The torch ranks replicating the plain tensors: ``plain_ranks`` if given, else every
    rank of the DTensors' meshes; with neither, nobody could say, so ValueError."""
    if plain_ranks is not None:
        ranks = np.asarray(list(plain_ranks))
        if ranks.size == 0 or not np.issubdtype(ranks.dtype, np.integer) or ranks.ndim != 1:
            raise ValueError(f"plain_ranks must be a non-empty list of torch ranks, got {plain_ranks!r}")
        return ranks.astype(np.int64)
    if mesh_ranks:
        return np.array(sorted(mesh_ranks), dtype=np.int64)
    name = plain[0][0]
    raise ValueError(
        f"{name!r} is a {type(plain[0][2]).__name__}, not a DTensor, and no DTensor mesh "
        f"says which ranks hold it: pass plain_ranks=[...] (the torch ranks that replicate it)"
    )


def _block_format(name: str, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> DestinationFormat:
    """The fp8-block{N} whose block grid of ``shape`` is ``scale_shape`` (128 preferred)."""
    fits = [n for n in (128, 16, 32, 64, 256, 512)
            if scale_shape == (*shape[:-2], -(-shape[-2] // n), -(-shape[-1] // n))]
    if not fits:
        raise ValueError(f"{name!r}: scale shape {scale_shape} is no N x N block grid of weight shape {shape}")
    return DestinationFormat(f"fp8-block{fits[0]}")


def formats_from_tensors(
    named: object, *, names: Mapping[str, str] | Callable[[str], str] | None = None
) -> TensorFormats:
    """Destination formats of a quantized model from its parameters (DTensors or plain):
    a ``float8_e4m3fn`` parameter ``p`` with a float32 ``p + "_scale_inv"`` of its block
    grid is ``fp8-block{N}`` (DeepSeek-V3 / vLLM), with a uint8 (or float8_e8m0fnu)
    ``p + "_scale"`` of shape ``[..., rows, ceil(cols / 32)]`` is ``mxfp8``. Keys are logical
    names (``names`` as in :func:`from_dtensors`). An FP8 parameter without a matching
    scale raises ``ValueError`` naming it."""
    import torch

    logical = _logical_namer(names)
    entries = dict(_named_tensors(named))
    found: dict[str, DestinationFormat] = {}
    for name, tensor in entries.items():
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float8_e4m3fn:
            continue
        shape = tuple(tensor.shape)
        inv, mx = entries.get(name + "_scale_inv"), entries.get(name + "_scale")
        if len(shape) >= 2 and inv is not None and inv.dtype == torch.float32:
            found[logical(name)] = _block_format(name, shape, tuple(inv.shape))
        elif (len(shape) >= 2 and mx is not None
              and mx.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))
              and tuple(mx.shape) == (*shape[:-1], -(-shape[-1] // MX_BLOCK))):
            found[logical(name)] = DestinationFormat("mxfp8")
        else:
            raise ValueError(
                f"{name!r} is float8_e4m3fn {list(shape)} but has no float32 {name + '_scale_inv'!r} "
                f"(fp8-block) or uint8 {name + '_scale'!r} (mxfp8) of its block grid"
            )
    return TensorFormats.from_mapping(found)


def local_shards(module_or_named: object) -> dict[str, torch.Tensor]:
    """Each parameter's local data by name: a DTensor's ``to_local()``, a plain tensor itself.

    Every value is detached and shares storage with the parameter, so in-place writes (the
    refit's receive) reach the model. The names are ``from_dtensors``' buffer names. A local
    tensor that is not contiguous raises ``ValueError`` naming it: the layout describes
    each buffer as one dense row-major block.
    """
    import torch
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for name, tensor in _named_tensors(module_or_named):
        if isinstance(tensor, DTensor):
            with torch.no_grad():
                local = tensor.to_local()
        elif isinstance(tensor, torch.Tensor):
            local = tensor
        else:
            raise ValueError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
        local = local.detach()
        if not local.is_contiguous():
            raise ValueError(
                f"parameter {name!r}: local tensor of shape {tuple(local.shape)} with strides "
                f"{tuple(local.stride())} is not contiguous"
            )
        out[name] = local
    return out
