"""DTensor-style constructors: a device mesh plus one placement per mesh axis.

``Shard(dim)`` follows ``torch.chunk`` semantics (chunks of ``ceil(n / k)``, trailing shards
may be short or empty) applied in mesh-axis order, exactly as
``torch.distributed.tensor._utils._compute_local_shape_and_global_offset`` does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from elastic_refit._validate import is_integer
from elastic_refit.layout.core import LayoutBuilder

__all__ = [
    "Placement",
    "Replicate",
    "Shard",
    "add_sharded_tensor",
    "from_dtensors",
    "parse_placement",
    "shard_boxes",
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
class Replicate:
    """Every rank along the mesh axis holds the same data."""

    def __str__(self) -> str:
        return "R"


Placement = Shard | Replicate

_SHARD_RE = re.compile(r"^\s*(?:S|Shard)\s*\(\s*(?:dim\s*=\s*)?(\d+)\s*\)\s*$")
_REPLICATE_RE = re.compile(r"^\s*(?:R|Replicate(?:\(\s*\))?)\s*$")


def parse_placement(text: object) -> Placement:
    """Parse ``"R"``, ``"Replicate()"``, ``"S(0)"`` or ``"Shard(0)"``."""
    if isinstance(text, Shard | Replicate):
        return text
    if not isinstance(text, str):
        raise ValueError(f"unknown placement {text!r}: use \"R\" or \"S(dim)\"")
    if _REPLICATE_RE.match(text):
        return Replicate()
    m = _SHARD_RE.match(text)
    if m:
        return Shard(int(m.group(1)))
    raise ValueError(f"unknown placement {text!r}: use \"R\" or \"S(dim)\"")


def shard_boxes(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> tuple[np.ndarray, np.ndarray]:
    """Global box of every mesh position, in row-major mesh order.

    Returns ``(offsets, lengths)``, each ``[prod(mesh_shape), len(shape)]``. Non-empty shards
    match torch exactly. An empty shard's offset is the end of the shard it was cut from
    (torch reports the dim's global size when several mesh axes split one dim); empty
    pieces are dropped from layouts, so plans never see the difference.
    """
    shape = tuple(int(s) for s in shape)
    mesh_shape = tuple(int(m) for m in mesh_shape)
    if len(placements) != len(mesh_shape):
        raise ValueError(
            f"{len(placements)} placements for a mesh with {len(mesh_shape)} axes "
            f"(mesh shape {mesh_shape})"
        )
    num = int(np.prod(mesh_shape)) if mesh_shape else 1
    coords = np.stack(np.unravel_index(np.arange(num), mesh_shape), axis=1) if mesh_shape else np.zeros((1, 0), np.int64)
    offsets = np.zeros((num, len(shape)), dtype=np.int64)
    lengths = np.tile(np.asarray(shape, dtype=np.int64), (num, 1))
    for axis, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        dim = placement.dim
        if dim >= len(shape):
            raise ValueError(f"placement {placement} on mesh axis {axis} is out of range for shape {shape}")
        k = mesh_shape[axis]
        size = lengths[:, dim]
        chunk = -(-size // k)  # ceil
        start = chunk * coords[:, axis]
        local = np.clip(np.minimum(size, start + chunk) - start, 0, None)
        offsets[:, dim] += np.where(size < start, size, start)
        lengths[:, dim] = local
    return offsets, lengths


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
    tensor name) and holds the rank's local shard contiguously.
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
    offsets, lengths = shard_boxes(shape, mesh_arr.shape, parsed)
    buffer_ids = builder.buffers(buffer or name, flat, lengths, dtype)
    builder.pieces(t, buffer_ids, offsets, lengths, np.zeros_like(offsets))


def from_dtensors(named: dict[str, object] | Sequence[tuple[str, object]]) -> LayoutBuilder:
    """A builder holding the layout of real ``torch.distributed.tensor.DTensor`` objects.

    Only ``Shard`` and ``Replicate`` placements are supported; ``Partial`` and strided
    shards raise ``ValueError`` naming the tensor.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Replicate as TorchReplicate
    from torch.distributed.tensor.placement_types import Shard as TorchShard

    builder = LayoutBuilder()
    items = named.items() if isinstance(named, dict) else named
    for name, dtensor in items:
        if not isinstance(dtensor, DTensor):
            raise ValueError(f"{name!r} is a {type(dtensor).__name__}, not a DTensor")
        placements: list[Placement] = []
        for p in dtensor.placements:
            if type(p) is TorchShard:
                placements.append(Shard(int(p.dim)))
            elif type(p) is TorchReplicate:
                placements.append(Replicate())
            else:
                raise ValueError(f"tensor {name!r}: placement {p} is not supported (only Shard and Replicate)")
        add_sharded_tensor(
            builder, name, tuple(dtensor.shape), dtensor.dtype,
            dtensor.device_mesh.mesh.cpu().numpy(), placements,
        )
    return builder
