"""Model presets: Megatron-core training layouts and vLLM inference layouts as piece lists.

Both constructors build from the layouts' rules (``layout.symbolic_presets``: per kind of
layer, one buffer rule per framework parameter and one piece rule per logical tensor in it,
over the parallel group's mesh), so the rules below are written once; the explicit layout
keeps its rules, and one rank can derive its own pieces from them alone.

Megatron-core (training), ``rank = first_rank + tp_rank + tp * (dp_rank + dp * pp_rank)``:

* Layers are split over ``pp`` stages; when ``pp`` does not divide the layer count the
  first ``num_layers % pp`` stages take one layer more (what Megatron's uneven-PP options
  such as ``decoder_first_pipeline_num_layers`` let one configure). Stages may be empty
  when ``pp > num_layers`` (only useful for cut models). Buffers use the stage-local layer
  index, as a stage's module does: ``decoder.layers.{local}.…``.
* ``linear_qkv`` per TP rank: for each of its kv groups, that group's q heads, then k,
  then v. Megatron-core divides the query groups over TP and refuses ``tp`` that does not
  divide the kv-head count; so do we.
* ``linear_fc1`` (dense and shared experts) per TP rank is ``[gate_i; up_i]``; ``linear_proj``
  and ``linear_fc2`` are row-parallel; norms (TE-fused ``layer_norm_weight`` where the TE
  spec fuses them) and the router are replicated.
* MLA: ``linear_q_down_proj`` / ``linear_kv_down_proj`` replicated, ``linear_q_up_proj`` /
  ``linear_kv_up_proj`` column-parallel by heads, ``linear_proj`` row-parallel.
* Routed experts with etp = 1: a stage's ``tp * dp`` ranks are re-factored as ``ep``
  (fastest) x ``edp``; an EP rank holds ``E / ep`` whole experts, stacked as one buffer
  ``mlp.experts.linear_fc1.weight`` ``[E_local, 2I, H]`` (gate rows ``[:, :I]``, up rows
  ``[:, I:]``) and ``mlp.experts.linear_fc2.weight`` ``[E_local, H, I]``. (TEGroupedMLP
  keeps one ``weight{e}`` tensor per local expert: row ``e`` of these stacks.)
* Vocab padded to a multiple of ``128 * tp`` (``make_vocab_size_divisible_by=128``);
  ``embedding.word_embeddings.weight`` on the first stage, ``output_layer.weight`` and
  ``decoder.final_layernorm.weight`` on the last. Padding rows belong to no piece.

vLLM (inference), ``rank = first_rank + tp_rank + tp * dp_rank``:

* ``qkv_proj`` per TP rank ``[q_local; k_local; v_local]``; when ``tp > num_kv_heads`` each
  rank holds one kv head, replicated ``tp / num_kv_heads`` times (as QKVParallelLinear).
* ``gate_up_proj`` ``[gate_i; up_i]``; ``down_proj`` / ``o_proj`` row-parallel.
* Experts ``mlp.experts.w13_weight`` ``[E_local, 2 I_local, H]`` and ``w2_weight``
  ``[E_local, H, I_local]``: with ``ep > 1`` whole experts over the EP ranks of the
  ``tp * dp`` group (``ep_rank = pos % ep``; uneven counts go to the first ranks, as
  vLLM's expert map does); with ``ep == 1`` every expert is TP-sharded along I (over
  ``tp``; over the whole ``tp * dp`` group with ``flatten_moe_tp=True``, as one vLLM
  engine with data-parallel attention does). vLLM itself only runs ``ep == tp * dp``; a
  smaller ``ep`` here means each EP shard is replicated ``tp * dp / ep`` times.
* MLA as vLLM stores it: ``fused_qkv_a_proj`` = ``[q_a_proj; kv_a_proj_with_mqa]``
  replicated, ``q_b_proj`` / ``kv_b_proj`` column-parallel by heads, ``o_proj`` row-parallel.
* VocabParallelEmbedding / ParallelLMHead: vocab padded to a multiple of 64, then split
  evenly over TP; padding rows belong to no piece. Tied embeddings have no ``lm_head``.

Destination formats (``checkpoint_formats``): a quantized inference side stores what the
published FP8 checkpoints of DeepSeek-V3 and Kimi-K2 quantize (``weight_block_size`` 128 x
128): every linear projection weight of attention (``q_a/q_b/kv_a_proj_with_mqa/kv_b/o``, or
``q/k/v/o``), of dense MLPs and of routed and shared experts (``gate/up/down``); norms, the
router (``mlp.gate``) and its bias, embeddings and the LM head stay BF16. The same rule is
applied to the other presets (their FP8 releases quantize the same set).
"""

from __future__ import annotations

import re

from elastic_refit.layout.core import Layout
from elastic_refit.layout.formats import DestinationFormat, TensorFormats, parse_format
from elastic_refit.layout.models import ModelConfig, get_model, logical_tensors
from elastic_refit.layout.parallelism import (
    MEGATRON_VOCAB_DIVISOR,
    VLLM_VOCAB_PADDING,
    InferenceParallelism,
    TrainingParallelism,
    parse_parallelism,
    stage_layers,
)
from elastic_refit.layout.symbolic_presets import megatron_symbolic, vllm_symbolic

__all__ = [
    "MEGATRON_VOCAB_DIVISOR",
    "VLLM_VOCAB_PADDING",
    "InferenceParallelism",
    "TrainingParallelism",
    "checkpoint_formats",
    "is_checkpoint_quantized",
    "megatron_layout",
    "parse_parallelism",
    "stage_layers",
    "vllm_layout",
]

def megatron_layout(config: ModelConfig | str, par: TrainingParallelism | str, first_rank: int = 0,
                    num_layers: int | None = None) -> Layout:
    """Megatron-core training layout of ``config`` (see the module docstring for the rules).

    ``rank = first_rank + tp_rank + tp * (dp_rank + dp * pp_rank)``. ``num_layers`` cuts the
    model to its first layers (embeddings and head kept). Built from its rules
    (``symbolic_presets.megatron_symbolic``), which the layout keeps (``symbolic.rules_of``:
    a member holding it publishes the rules, kilobytes at any scale).
    """
    return megatron_symbolic(config, par, first_rank, num_layers).to_layout()


def vllm_layout(config: ModelConfig | str, par: InferenceParallelism | str, first_rank: int = 0,
                num_layers: int | None = None, flatten_moe_tp: bool = False) -> Layout:
    """vLLM inference layout of ``config`` (see the module docstring for the rules).

    ``rank = first_rank + tp_rank + tp * dp_rank``. With ``ep == 1`` experts are TP-sharded
    over ``tp`` (independent engines per DP replica) or, with ``flatten_moe_tp``, over all
    ``tp * dp`` ranks. ``num_layers`` cuts the model to its first layers. Built from its
    rules (``symbolic_presets.vllm_symbolic``), which the layout keeps.
    """
    return vllm_symbolic(config, par, first_rank, num_layers, flatten_moe_tp).to_layout()


# ---- destination formats -------------------------------------------------------------------
# Linear projections inside a decoder layer: attention, dense MLP, routed and shared experts.
_QUANTIZED_RE = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(experts\.|shared_experts\.)?"
                           r"[a-z_]*proj(_with_mqa)?\.weight$")


def is_checkpoint_quantized(tensor: str) -> bool:
    """Whether the published FP8 checkpoints quantize logical tensor ``tensor`` (HF name):
    the linear projection weights of attention, MLP and experts; not norms, the router,
    embeddings or the LM head (module docstring)."""
    return _QUANTIZED_RE.match(tensor) is not None


def checkpoint_formats(config: ModelConfig | str, fmt: DestinationFormat | str = "fp8-block128",
                       num_layers: int | None = None) -> TensorFormats:
    """Destination formats of a quantized inference side of ``config``: ``fmt`` for every
    tensor :func:`is_checkpoint_quantized` selects (``bf16``: none), the rest ``bf16``."""
    fmt = parse_format(fmt)
    if not fmt.quantized:
        return TensorFormats()
    c = get_model(config).with_layers(num_layers)
    return TensorFormats.uniform([t.name for t in logical_tensors(c) if is_checkpoint_quantized(t.name)], fmt)
