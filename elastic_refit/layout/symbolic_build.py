"""``SymbolicBuilder``: declare tensors, buffers and rules; ``build`` a ``SymbolicLayout``.

``sharded_tensor`` is ``dtensor.add_sharded_tensor`` as a rule: a mesh of rank ids plus one
DTensor placement per mesh axis (``Shard``, ``_StridedShard``, ``Replicate``), the rank's
local shard in its own buffer; ``to_layout()`` of the result has exactly the pieces and
buffers ``add_sharded_tensor`` declares.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from elastic_refit.layout.core import LayoutBuilder, LogicalTensor
from elastic_refit.layout.dtensor import Placement, Replicate, Shard, StridedShard, parse_placement
from elastic_refit.layout.symbolic import BufferRule, Mesh, PieceRule, Split, SymbolicLayout

__all__ = ["SymbolicBuilder", "placement_splits"]


def placement_splits(placements: Sequence[Placement | str]) -> tuple[Split, ...]:
    """The splits of DTensor placements, one per mesh axis in order (``Replicate``: none)."""
    splits = []
    for axis, text in enumerate(placements):
        p = parse_placement(text)
        if isinstance(p, StridedShard):
            splits.append(Split("strided", p.dim, axis, p.split_factor))
        elif isinstance(p, Shard):
            splits.append(Split("chunk", p.dim, axis))
        elif not isinstance(p, Replicate):  # pragma: no cover - parse_placement returns only these
            raise ValueError(f"unknown placement {p!r}")
    return tuple(splits)


class SymbolicBuilder:
    """Accumulates tensors, buffer rules and piece rules (and explicit pieces for what no rule
    describes: ``explicit``, a ``LayoutBuilder`` whose tensors ``build`` declares)."""

    def __init__(self) -> None:
        self._tensors: dict[str, LogicalTensor] = {}
        self._buffers: list[BufferRule] = []
        self._buffer_names: set[str] = set()
        self._rules: list[PieceRule] = []
        self._explicit: LayoutBuilder | None = None

    @property
    def explicit(self) -> LayoutBuilder:
        """Pieces no rule describes (a ``LayoutBuilder`` with every tensor declared so far and
        later); made on first use (most layouts have none)."""
        if self._explicit is None:
            self._explicit = LayoutBuilder()
            for t in self._tensors.values():
                self._explicit.tensor(t.name, t.shape, t.dtype)
        return self._explicit

    def tensor(self, name: str, shape: Sequence[int], dtype: object) -> str:
        """Declare a logical tensor (idempotent for identical declarations)."""
        t = LogicalTensor(name, tuple(shape), dtype)  # type: ignore[arg-type]
        old = self._tensors.setdefault(name, t)
        if old != t:
            raise ValueError(f"tensor {name!r} declared twice with different shape/dtype: "
                             f"{old.shape} {old.dtype} vs {t.shape} {t.dtype}")
        if self._explicit is not None:
            self._explicit.tensor(name, t.shape, t.dtype)  # so explicit pieces may name it
        return name

    def buffer(self, name: str, mesh: Mesh | np.ndarray | Sequence, shape: Sequence[int], dtype: object,
               splits: Sequence[Split] = ()) -> None:
        """Buffer ``name`` on every rank of ``mesh``, of the local shape of ``shape`` under ``splits``."""
        mesh = mesh if isinstance(mesh, Mesh) else Mesh.of(mesh)
        self._buffers.append(BufferRule(name, mesh, tuple(shape), dtype, tuple(splits)))  # type: ignore[arg-type]
        self._buffer_names.add(name)

    def rule(self, tensor: str, buffer: str, mesh: Mesh | np.ndarray | Sequence, splits: Sequence[Split] = (),
             local_dim: int = 0, local_start: int = 0) -> None:
        """Tensor ``tensor`` cut by ``splits`` over ``mesh``, in ``buffer`` at ``local_start``
        along ``local_dim``."""
        if tensor not in self._tensors:
            raise ValueError(f"tensor {tensor!r} is not declared; call tensor() first")
        mesh = mesh if isinstance(mesh, Mesh) else Mesh.of(mesh)
        self._rules.append(PieceRule(tensor, buffer, mesh, tuple(splits), local_dim, local_start))

    def sharded_tensor(self, name: str, shape: Sequence[int], dtype: object, mesh: np.ndarray | Sequence | Mesh,
                       placements: Sequence[Placement | str], buffer: str | None = None) -> None:
        """``add_sharded_tensor`` as a rule (module docstring)."""
        if not isinstance(mesh, Mesh):
            array = np.asarray(mesh)
            if array.size == 0 or not np.issubdtype(array.dtype, np.integer):
                raise ValueError(f"tensor {name!r}: mesh must be a non-empty nested list of rank ids, got {mesh!r}")
            mesh = Mesh.of(array)
        if len(placements) != len(mesh.shape):
            raise ValueError(f"{len(placements)} placements for a mesh with {len(mesh.shape)} axes "
                             f"(mesh shape {mesh.shape})")
        splits = placement_splits(placements)
        self.tensor(name, shape, dtype)
        self.buffer(buffer or name, mesh, shape, dtype, splits)
        self.rule(name, buffer or name, mesh, splits)

    def build(self) -> SymbolicLayout:
        tensors = tuple(self._tensors[n] for n in sorted(self._tensors))
        if self._explicit is None:
            return SymbolicLayout(tensors, tuple(self._buffers), tuple(self._rules))
        for t in tensors:
            self.explicit.tensor(t.name, t.shape, t.dtype)
        explicit = self.explicit.build()
        if explicit.tensors != tensors:
            extra = sorted({t.name for t in explicit.tensors} - set(self._tensors))
            raise ValueError(f"explicit pieces of undeclared tensors {extra[:4]}: declare them with tensor()")
        has_explicit = explicit.num_buffers > 0 or bool(explicit.buffer_names)
        return SymbolicLayout(tensors, tuple(self._buffers), tuple(self._rules), explicit if has_explicit else None)
