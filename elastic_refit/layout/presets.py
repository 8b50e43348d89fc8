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
from dataclasses import dataclass

import numpy as np

from elastic_refit._validate import is_integer
from elastic_refit.layout.core import Layout
from elastic_refit.layout.formats import DestinationFormat, TensorFormats, parse_format
from elastic_refit.layout.models import ModelConfig, get_model, logical_tensors

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

MEGATRON_VOCAB_DIVISOR = 128  # Megatron's default make_vocab_size_divisible_by
VLLM_VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


# ---- parallelism specs ---------------------------------------------------------------------
def _check_sizes(kind: str, why: str = "", **sizes: int) -> None:
    """Every size a positive integer, and ``ep`` dividing ``tp * dp`` (``why`` ends that error)."""
    for key, value in sizes.items():
        if not is_integer(value, numpy=True) or value < 1:
            raise ValueError(f"{kind}: {key} must be a positive integer, got {value!r}")
    tp, dp, ep = sizes["tp"], sizes["dp"], sizes["ep"]
    if (tp * dp) % ep:
        raise ValueError(f"{kind}: ep={ep} must divide tp*dp={tp * dp}{why}")


@dataclass(frozen=True, slots=True)
class TrainingParallelism:
    """Megatron-style training sizes: tensor, pipeline, data and expert parallel (etp = 1)."""

    tp: int
    pp: int
    dp: int
    ep: int = 1

    def __post_init__(self) -> None:
        _check_sizes(
            "training parallelism",
            " (experts re-factor a stage's tp x dp ranks as ep x edp)",
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            ep=self.ep,
        )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        return f"tp={self.tp},pp={self.pp},dp={self.dp},ep={self.ep}"


@dataclass(frozen=True, slots=True)
class InferenceParallelism:
    """vLLM-style inference sizes: tensor and data parallel, optional expert parallel."""

    tp: int
    dp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        _check_sizes("inference parallelism", tp=self.tp, dp=self.dp, ep=self.ep)

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    def __str__(self) -> str:
        return f"tp={self.tp},dp={self.dp},ep={self.ep}"


_KEYS = ("tp", "pp", "dp", "ep", "etp")


def parse_parallelism(
    text: str, side: str | None = None
) -> TrainingParallelism | InferenceParallelism:
    """Parse ``"tp=4,pp=8,ep=16,dp=4"``; missing sizes are 1.

    ``side``: ``"training"`` gives a ``TrainingParallelism``, ``"inference"`` an
    ``InferenceParallelism`` (which has no ``pp``); ``None`` picks training when ``pp`` is
    given. ``etp`` is accepted only as 1 (expert tensor parallelism is not modelled).
    """
    if side not in (None, "training", "inference"):
        raise ValueError(f"side must be 'training', 'inference' or None, got {side!r}")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"parallelism must be a string like 'tp=4,pp=8,ep=16,dp=4', got {text!r}")
    sizes: dict[str, int] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or not key:
            raise ValueError(f"bad parallelism item {item.strip()!r} in {text!r}: use key=value")
        if key not in _KEYS:
            raise ValueError(f"unknown parallelism key {key!r} in {text!r}; known: {', '.join(_KEYS)}")
        if key in sizes:
            raise ValueError(f"parallelism key {key!r} given twice in {text!r}")
        try:
            number = int(value.strip())
        except ValueError:
            raise ValueError(f"parallelism {key}={value.strip()!r} in {text!r} is not an integer") from None
        if number < 1:
            raise ValueError(f"parallelism {key}={number} in {text!r} must be >= 1")
        sizes[key] = number
    if sizes.pop("etp", 1) != 1:
        raise ValueError(f"{text!r}: only etp=1 (whole experts per EP rank) is supported")
    if side == "training" or (side is None and "pp" in sizes):
        return TrainingParallelism(sizes.get("tp", 1), sizes.get("pp", 1), sizes.get("dp", 1), sizes.get("ep", 1))
    if sizes.get("pp", 1) != 1:
        raise ValueError(f"{text!r}: inference layouts have no pipeline stages (pp={sizes['pp']})")
    return InferenceParallelism(sizes.get("tp", 1), sizes.get("dp", 1), sizes.get("ep", 1))


def _as_training(par: TrainingParallelism | InferenceParallelism | str) -> TrainingParallelism:
    if isinstance(par, str):
        par = parse_parallelism(par, side="training")
    if isinstance(par, InferenceParallelism):
        return TrainingParallelism(par.tp, 1, par.dp, par.ep)
    if not isinstance(par, TrainingParallelism):
        raise ValueError(f"expected a TrainingParallelism or a 'tp=..,pp=..' string, got {par!r}")
    return par


def _as_inference(par: TrainingParallelism | InferenceParallelism | str) -> InferenceParallelism:
    if isinstance(par, str):
        par = parse_parallelism(par, side="inference")
    if isinstance(par, TrainingParallelism):
        if par.pp != 1:
            raise ValueError(f"vLLM layouts have no pipeline stages, got {par}")
        return InferenceParallelism(par.tp, par.dp, par.ep)
    if not isinstance(par, InferenceParallelism):
        raise ValueError(f"expected an InferenceParallelism or a 'tp=..,dp=..' string, got {par!r}")
    return par


def _check_first_rank(first_rank: int) -> int:
    if not is_integer(first_rank, numpy=True) or first_rank < 0:
        raise ValueError(f"first_rank must be an integer >= 0, got {first_rank!r}")
    return int(first_rank)


# ---- shared by the rules ---------------------------------------------------------------------
def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Global layer indices of each pipeline stage: the first ``num_layers % pp`` stages
    take one layer more; stages may be empty when ``pp > num_layers``."""
    base, extra = divmod(num_layers, pp)
    counts = [base + (s < extra) for s in range(pp)]
    starts = np.concatenate([[0], np.cumsum(counts)])
    return [range(int(starts[s]), int(starts[s + 1])) for s in range(pp)]


# ---- the constructors (from the rules) ------------------------------------------------------
def megatron_layout(config: ModelConfig | str, par: TrainingParallelism | str, first_rank: int = 0,
                    num_layers: int | None = None) -> Layout:
    """Megatron-core training layout of ``config`` (see the module docstring for the rules).

    ``rank = first_rank + tp_rank + tp * (dp_rank + dp * pp_rank)``. ``num_layers`` cuts the
    model to its first layers (embeddings and head kept). Built from its rules
    (``symbolic_presets.megatron_symbolic``), which the layout keeps (``symbolic.rules_of``:
    a member holding it publishes the rules, kilobytes at any scale).
    """
    from elastic_refit.layout.symbolic_presets import megatron_symbolic  # it imports this module

    return megatron_symbolic(config, par, first_rank, num_layers).to_layout()


def vllm_layout(config: ModelConfig | str, par: InferenceParallelism | str, first_rank: int = 0,
                num_layers: int | None = None, flatten_moe_tp: bool = False) -> Layout:
    """vLLM inference layout of ``config`` (see the module docstring for the rules).

    ``rank = first_rank + tp_rank + tp * dp_rank``. With ``ep == 1`` experts are TP-sharded
    over ``tp`` (independent engines per DP replica) or, with ``flatten_moe_tp``, over all
    ``tp * dp`` ranks. ``num_layers`` cuts the model to its first layers. Built from its
    rules (``symbolic_presets.vllm_symbolic``), which the layout keeps.
    """
    from elastic_refit.layout.symbolic_presets import vllm_symbolic  # it imports this module

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
