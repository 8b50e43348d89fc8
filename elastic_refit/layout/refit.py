"""A refit between two preset layouts of one model on a uniform topology."""

from __future__ import annotations

from elastic_refit.layout.core import Topology
from elastic_refit.layout.formats import DestinationFormat
from elastic_refit.layout.models import ModelConfig
from elastic_refit.layout.presets import (
    checkpoint_formats,
    megatron_layout,
    parse_parallelism,
    vllm_layout,
)
from elastic_refit.layout.spec import RefitSpec
from elastic_refit.layout.symbolic import SymbolicLayout
from elastic_refit.layout.symbolic_presets import megatron_symbolic, vllm_symbolic

__all__ = ["model_refit_rules", "model_refit_spec"]


def model_refit_spec(
    model: str | ModelConfig,
    source: str,
    destination: str,
    *,
    domain_size: int = 8,
    num_layers: int | None = None,
    colocate: bool = False,
    destination_format: DestinationFormat | str = "bf16",
) -> RefitSpec:
    """Megatron-style ``source`` -> vLLM-style ``destination`` for ``model``.

    Source ranks are ``0..S-1``; destination ranks follow them (``S..S+D-1``) unless
    ``colocate``, when both sides start at rank 0 and share devices. ``destination_format``
    (``"fp8-block128"``, ``"mxfp8"``) quantizes what the model's FP8 checkpoints quantize
    (``checkpoint_formats``); the layouts are the same either way.
    """
    train = parse_parallelism(source, side="training")
    infer = parse_parallelism(destination, side="inference")
    first_dst = 0 if colocate else train.world_size
    src = megatron_layout(model, train, first_rank=0, num_layers=num_layers)
    dst = vllm_layout(model, infer, first_rank=first_dst, num_layers=num_layers)
    num_ranks = max(train.world_size, first_dst + infer.world_size)
    formats = checkpoint_formats(model, destination_format, num_layers=num_layers)
    return RefitSpec(src, dst, Topology.uniform(num_ranks, domain_size), formats)


def model_refit_rules(model: str | ModelConfig, source: str, destination: str, *, domain_size: int = 8,
                      num_layers: int | None = None,
                      colocate: bool = False) -> tuple[SymbolicLayout, SymbolicLayout, Topology]:
    """``model_refit_spec``'s layouts as rules (``symbolic_presets``) and its topology: what
    one rank plans its own view from (``plan.rank_rules``) without any side's explicit pieces."""
    train = parse_parallelism(source, side="training")
    infer = parse_parallelism(destination, side="inference")
    first_dst = 0 if colocate else train.world_size
    src = megatron_symbolic(model, train, first_rank=0, num_layers=num_layers)
    dst = vllm_symbolic(model, infer, first_rank=first_dst, num_layers=num_layers)
    num_ranks = max(train.world_size, first_dst + infer.world_size)
    return src, dst, Topology.uniform(num_ranks, domain_size)
