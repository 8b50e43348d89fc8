"""The layout language: logical tensors, boxes, pieces, layouts, topologies, constructors."""

from elastic_refit.layout.box import DTYPE_ITEMSIZE, DTYPES, Box, canonical_dtype
from elastic_refit.layout.core import (
    Buffer,
    Layout,
    LayoutBuilder,
    LogicalTensor,
    Piece,
    Topology,
)
from elastic_refit.layout.dtensor import (
    Placement,
    Replicate,
    Shard,
    add_sharded_tensor,
    from_dtensors,
    parse_placement,
    shard_boxes,
)
from elastic_refit.layout.spec import RefitSpec, load_spec, parse_spec

__all__ = [
    "DTYPES",
    "DTYPE_ITEMSIZE",
    "Box",
    "Buffer",
    "Layout",
    "LayoutBuilder",
    "LogicalTensor",
    "Piece",
    "Placement",
    "RefitSpec",
    "Replicate",
    "Shard",
    "Topology",
    "add_sharded_tensor",
    "canonical_dtype",
    "from_dtensors",
    "load_spec",
    "parse_placement",
    "parse_spec",
    "shard_boxes",
]
