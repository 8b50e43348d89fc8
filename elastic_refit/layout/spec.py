"""Declarative layout spec files (JSON).

```
{"domain_size": 8,                      # or "domains": [domain of rank 0, of rank 1, ...]
 "tensors": [{"name": "w", "shape": [1024, 4096], "dtype": "bfloat16",
   "source":      {"mesh": [[0, 1], [2, 3]], "placements": ["R", "S(0)"]},
   "destination": {"mesh": [4, 5, 6, 7],     "placements": ["S(1)"]}}]}
```
Placements are ``"R"``, ``"S(d)"`` or ``"_S(d, k)"`` (a strided shard), one per mesh axis,
with DTensor semantics. A destination may name its format, ``"destination": {"mesh": ...,
"placements": ..., "format": "fp8-block128"}`` (``elastic_refit.layout.formats``; default
``bf16``); formats are kept in ``RefitSpec.destination_formats``, beside the layouts, whose
fingerprints they leave unchanged. A side may hold a tensor in its own ``"dtype"`` (a
destination in ``bfloat16`` where the source is ``float32``: the refit casts it,
``elastic_refit.layout.casts``). A rank may appear in both meshes (colocated training and
inference).
A side file (``load_side``) describes one side only: each tensor has its own ``mesh`` and
``placements``, in that side's ranks, and optionally a ``format`` (``load_side_formats``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from elastic_refit.layout.core import MAX_RANKS, Layout, LayoutBuilder, Topology
from elastic_refit.layout.dtensor import add_sharded_tensor
from elastic_refit.layout.formats import TensorFormats, parse_format

__all__ = ["RefitSpec", "load_side", "load_side_formats", "load_spec", "parse_side", "parse_side_formats",
           "parse_spec"]


@dataclass(frozen=True, slots=True)
class RefitSpec:
    """A source layout, a destination layout and the topology they live on, plus how the
    destination stores each tensor (``bf16`` unless ``destination_formats`` says otherwise)."""

    source: Layout
    destination: Layout
    topology: Topology
    destination_formats: TensorFormats = field(default_factory=TensorFormats)

    def __post_init__(self) -> None:
        if not isinstance(self.destination_formats, TensorFormats):
            raise ValueError(f"destination_formats must be a TensorFormats, got {self.destination_formats!r}")
        self.destination_formats.check(self.destination.tensors)


def _require(obj: dict[str, Any], key: str, where: str) -> Any:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
    if key not in obj:
        raise ValueError(f"{where}: missing key {key!r}")
    return obj[key]


def _tensor_entry(entry: Any, where: str, origin: str) -> tuple[str, list[int], str, str]:
    name = _require(entry, "name", where)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: 'name' must be a non-empty string")
    where = f"{origin}: tensor {name!r}"
    shape = _require(entry, "shape", where)
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ValueError(f"{where}: 'shape' must be a list of integers >= 0, got {shape!r}")
    return name, shape, entry.get("dtype", "float32"), where


def _add_placed(builder: LayoutBuilder, name: str, shape: list[int], dtype: str, placed: Any, where: str) -> int:
    """Add one tensor laid out by ``{"mesh", "placements"}``; returns its highest rank (-1: none)."""
    mesh = _require(placed, "mesh", where)
    placements = _require(placed, "placements", where)
    try:
        mesh_arr = np.asarray(mesh)
    except ValueError:
        raise ValueError(f"{where}: mesh is ragged: {mesh!r}") from None
    if mesh_arr.dtype == object or (mesh_arr.size and not np.issubdtype(mesh_arr.dtype, np.integer)):
        raise ValueError(f"{where}: mesh must be nested lists of rank ids, got {mesh!r}")
    if mesh_arr.size and not 0 <= int(mesh_arr.min()) <= int(mesh_arr.max()) < MAX_RANKS:
        raise ValueError(f"{where}: rank ids must be in [0, {MAX_RANKS}), got "
                         f"{int(mesh_arr.min()) if int(mesh_arr.min()) < 0 else int(mesh_arr.max())}")
    if not isinstance(placements, list):
        raise ValueError(f"{where}: 'placements' must be a list, got {placements!r}")
    try:
        add_sharded_tensor(builder, name, shape, dtype, mesh_arr, placements)
    except ValueError as exc:  # `where` names the tensor already
        raise ValueError(f"{where}: {str(exc).removeprefix(f'tensor {name!r}: ')}") from None
    return int(mesh_arr.max()) if mesh_arr.size else -1


def _format_of(placed: Any, name: str, where: str, formats: dict[str, Any]) -> None:
    """Record ``placed["format"]`` (if any) for tensor ``name``."""
    if isinstance(placed, dict) and "format" in placed:
        try:
            formats[name] = parse_format(placed["format"])
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


def _checked_formats(formats: dict[str, Any], layout: Layout, origin: str) -> TensorFormats:
    result = TensorFormats.from_mapping(formats)
    try:
        result.check(layout.tensors)
    except ValueError as exc:
        raise ValueError(f"{origin}: {exc}") from None
    return result


def parse_side(data: Any, origin: str = "layout") -> Layout:
    """One side's layout from the decoded JSON of a side file: like a spec file, but each
    tensor has its own ``mesh`` and ``placements`` (ranks of this side, from 0) instead of a
    ``source`` and a ``destination``: ``{"tensors": [{"name": "w", "shape": [1024, 4096],
    "dtype": "bfloat16", "mesh": [0, 1, 2, 3], "placements": ["S(1)"]}]}``."""
    tensors = _require(data, "tensors", origin)
    if not isinstance(tensors, list) or not tensors:
        raise ValueError(f"{origin}: 'tensors' must be a non-empty list")
    builder = LayoutBuilder()
    for i, entry in enumerate(tensors):
        name, shape, dtype, where = _tensor_entry(entry, f"{origin}: tensors[{i}]", origin)
        _add_placed(builder, name, shape, dtype, entry, where)
    return builder.build()


def parse_spec(data: Any, origin: str = "spec") -> RefitSpec:
    """Build a ``RefitSpec`` from the decoded JSON of a spec file."""
    tensors = _require(data, "tensors", origin)
    if not isinstance(tensors, list) or not tensors:
        raise ValueError(f"{origin}: 'tensors' must be a non-empty list")
    source, destination = LayoutBuilder(), LayoutBuilder()
    formats: dict[str, Any] = {}
    max_rank = -1
    for i, entry in enumerate(tensors):
        name, shape, dtype, where = _tensor_entry(entry, f"{origin}: tensors[{i}]", origin)
        for side, builder in (("source", source), ("destination", destination)):
            side_spec = _require(entry, side, where)
            # a side may hold the tensor in its own dtype (a refit casts: layout.casts)
            held = side_spec.get("dtype", dtype) if isinstance(side_spec, dict) else dtype
            max_rank = max(max_rank, _add_placed(builder, name, shape, held, side_spec, f"{where} {side}"))
        if isinstance(entry["source"], dict) and "format" in entry["source"]:
            raise ValueError(f"{where} source: 'format' describes how the destination stores a tensor; "
                             f"put it in 'destination'")
        _format_of(entry["destination"], name, f"{where} destination", formats)
    if "domains" in data:
        domains = data["domains"]
        if not isinstance(domains, list) or not all(isinstance(d, int) and d >= 0 for d in domains):
            raise ValueError(f"{origin}: 'domains' must be a list of integers >= 0")
        if len(domains) <= max_rank:
            raise ValueError(f"{origin}: 'domains' lists {len(domains)} ranks but the meshes use rank {max_rank}")
        topology = Topology(tuple(domains))
    else:
        domain_size = data.get("domain_size", 8)
        if not isinstance(domain_size, int) or domain_size < 1:
            raise ValueError(f"{origin}: 'domain_size' must be an integer >= 1, got {domain_size!r}")
        topology = Topology.uniform(max_rank + 1, domain_size)
    src_layout, dst_layout = source.build(), destination.build()
    return RefitSpec(src_layout, dst_layout, topology, _checked_formats(formats, dst_layout, origin))


def parse_side_formats(data: Any, origin: str = "layout") -> TensorFormats:
    """The destination formats a side file declares (per-tensor ``"format"``; none: all
    ``bf16``), checked against the side's layout."""
    layout = parse_side(data, origin)
    formats: dict[str, Any] = {}
    for i, entry in enumerate(data["tensors"]):
        _format_of(entry, entry["name"], f"{origin}: tensors[{i}]", formats)
    return _checked_formats(formats, layout, origin)


def load_side_formats(path: str | Path) -> TensorFormats:
    """:func:`parse_side_formats` of a side file."""
    return parse_side_formats(_read_json(path, "layout file"), origin=str(path))


def load_spec(path: str | Path) -> RefitSpec:
    """Read a spec file; every problem is one ``ValueError`` naming the file and the tensor."""
    return parse_spec(_read_json(path, "spec file"), origin=str(path))


def load_side(path: str | Path) -> Layout:
    """Read one side's layout file (:func:`parse_side`); errors as :func:`load_spec`'s."""
    return parse_side(_read_json(path, "layout file"), origin=str(path))


def _read_json(path: str | Path, what: str) -> Any:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"{what} {str(path)!r} is a directory") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what} {str(path)!r} cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to read") from None
