"""Declarative layout spec files (JSON).

```
{"domain_size": 8,                      # or "domains": [domain of rank 0, of rank 1, ...]
 "tensors": [{"name": "w", "shape": [1024, 4096], "dtype": "bfloat16",
   "source":      {"mesh": [[0, 1], [2, 3]], "placements": ["R", "S(0)"]},
   "destination": {"mesh": [4, 5, 6, 7],     "placements": ["S(1)"]}}]}
```
Placements are ``"R"`` or ``"S(d)"``, one per mesh axis, with DTensor semantics. A rank
may appear in both meshes (colocated training and inference).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from elastic_refit.layout.core import MAX_RANKS, Layout, LayoutBuilder, Topology
from elastic_refit.layout.dtensor import add_sharded_tensor

__all__ = ["RefitSpec", "load_spec", "parse_spec"]


@dataclass(frozen=True, slots=True)
class RefitSpec:
    """A source layout, a destination layout and the topology they live on."""

    source: Layout
    destination: Layout
    topology: Topology


def _require(obj: dict[str, Any], key: str, where: str) -> Any:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
    if key not in obj:
        raise ValueError(f"{where}: missing key {key!r}")
    return obj[key]


def parse_spec(data: Any, origin: str = "spec") -> RefitSpec:
    """Build a ``RefitSpec`` from the decoded JSON of a spec file."""
    tensors = _require(data, "tensors", origin)
    if not isinstance(tensors, list) or not tensors:
        raise ValueError(f"{origin}: 'tensors' must be a non-empty list")
    source, destination = LayoutBuilder(), LayoutBuilder()
    max_rank = -1
    for i, entry in enumerate(tensors):
        where = f"{origin}: tensors[{i}]"
        name = _require(entry, "name", where)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: 'name' must be a non-empty string")
        where = f"{origin}: tensor {name!r}"
        shape = _require(entry, "shape", where)
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ValueError(f"{where}: 'shape' must be a list of integers >= 0, got {shape!r}")
        dtype = entry.get("dtype", "float32")
        for side, builder in (("source", source), ("destination", destination)):
            side_spec = _require(entry, side, where)
            mesh = _require(side_spec, "mesh", f"{where} {side}")
            placements = _require(side_spec, "placements", f"{where} {side}")
            try:
                mesh_arr = np.asarray(mesh)
            except ValueError:
                raise ValueError(f"{where} {side}: mesh is ragged: {mesh!r}") from None
            if mesh_arr.dtype == object or (mesh_arr.size and not np.issubdtype(mesh_arr.dtype, np.integer)):
                raise ValueError(f"{where} {side}: mesh must be nested lists of rank ids, got {mesh!r}")
            if mesh_arr.size and not 0 <= int(mesh_arr.min()) <= int(mesh_arr.max()) < MAX_RANKS:
                raise ValueError(f"{where} {side}: rank ids must be in [0, {MAX_RANKS}), got "
                                 f"{int(mesh_arr.min()) if int(mesh_arr.min()) < 0 else int(mesh_arr.max())}")
            if not isinstance(placements, list):
                raise ValueError(f"{where} {side}: 'placements' must be a list, got {placements!r}")
            try:
                add_sharded_tensor(builder, name, shape, dtype, mesh_arr, placements)
            except ValueError as exc:
                raise ValueError(f"{where} {side}: {exc}") from None
            if mesh_arr.size:
                max_rank = max(max_rank, int(mesh_arr.max()))
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
    return RefitSpec(source.build(), destination.build(), topology)


def load_spec(path: str | Path) -> RefitSpec:
    """Read a spec file; every problem is one ``ValueError`` naming the file and the tensor."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"spec file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"spec file {str(path)!r} is a directory") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"spec file {str(path)!r} cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data = json.loads(text)
        return parse_spec(data, origin=str(path))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to read") from None
