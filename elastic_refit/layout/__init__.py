"""The layout language: logical tensors, boxes, pieces, layouts, topologies, constructors."""

from elastic_refit.layout.box import DTYPE_ITEMSIZE, DTYPES, Box, canonical_dtype
from elastic_refit.layout.core import (
    Buffer,
    Layout,
    LayoutBuilder,
    LogicalTensor,
    Piece,
    Topology,
    combine_layouts,
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
from elastic_refit.layout.encoding import decode_layout, encode_layout
from elastic_refit.layout.models import (
    MODELS,
    ModelConfig,
    config_from_hf,
    get_model,
    logical_tensors,
    parameter_count,
)
from elastic_refit.layout.presets import (
    InferenceParallelism,
    TrainingParallelism,
    megatron_layout,
    parse_parallelism,
    stage_layers,
    vllm_layout,
)
from elastic_refit.layout.spec import RefitSpec, load_spec, parse_spec

__all__ = [
    "DTYPES",
    "DTYPE_ITEMSIZE",
    "MODELS",
    "Box",
    "Buffer",
    "InferenceParallelism",
    "Layout",
    "LayoutBuilder",
    "LogicalTensor",
    "ModelConfig",
    "Piece",
    "Placement",
    "RefitSpec",
    "Replicate",
    "Shard",
    "Topology",
    "TrainingParallelism",
    "add_sharded_tensor",
    "canonical_dtype",
    "combine_layouts",
    "config_from_hf",
    "decode_layout",
    "encode_layout",
    "from_dtensors",
    "get_model",
    "load_spec",
    "logical_tensors",
    "megatron_layout",
    "parameter_count",
    "parse_parallelism",
    "parse_placement",
    "parse_spec",
    "shard_boxes",
    "stage_layers",
    "vllm_layout",
]
