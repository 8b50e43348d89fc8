"""Model presets: Megatron-core training layouts and vLLM inference layouts as piece lists.

Both constructors compute, once per kind of layer, *templates*: for every rank position of
a parallel group (``pos = tp_rank + tp * dp_rank``) the global boxes of each logical tensor
that its buffer holds and where they sit inside the buffer. Emitting a layer is then one
``buffers`` call per framework parameter and one ``pieces`` call per logical tensor in it,
vectorised over ranks, so full-scale layouts (hundreds of ranks) build in well under a
second.

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
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from elastic_refit._validate import is_integer
from elastic_refit.layout.core import Layout, LayoutBuilder
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


# ---- templates -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Part:
    """One logical tensor's pieces in one parameter, for every position of the group."""

    tensor: str
    shape: tuple[int, ...]
    dtype: str
    pos: np.ndarray  # [P] group position whose buffer holds the piece
    offsets: np.ndarray  # [P, K]
    lengths: np.ndarray  # [P, K]
    local_offsets: np.ndarray  # [P, K]


@dataclass(frozen=True, slots=True)
class _Param:
    """One framework parameter: a buffer on every group position and the tensors in it."""

    buffer: str
    shape: np.ndarray  # [K] or [num_positions, K]
    dtype: str
    parts: tuple[_Part, ...]


def _part(tensor: str, shape: Sequence[int], dtype: str, pos: np.ndarray, dim: int | None = None,
          start: np.ndarray | int = 0, size: np.ndarray | int = 0, local_dim: int = 0,
          local_start: np.ndarray | int = 0) -> _Part:
    """Pieces at positions ``pos``: the whole tensor, or along ``dim`` only
    ``[start, start + size)`` clipped to the tensor; placed at ``local_start`` along
    ``local_dim`` of the buffer (0 elsewhere)."""
    shape = tuple(int(s) for s in shape)
    pos = np.asarray(pos, dtype=np.int64)
    n, k = pos.size, len(shape)
    offsets = np.zeros((n, k), dtype=np.int64)
    lengths = np.tile(np.asarray(shape, dtype=np.int64), (n, 1))
    if dim is not None:
        start = np.broadcast_to(np.asarray(start, dtype=np.int64), (n,))
        stop = np.minimum(start + np.broadcast_to(np.asarray(size, dtype=np.int64), (n,)), shape[dim])
        clipped = np.minimum(start, shape[dim])  # empty tail shards stay in bounds, then get dropped
        offsets[:, dim] = clipped
        lengths[:, dim] = np.maximum(stop - clipped, 0)
    local_offsets = np.zeros((n, k), dtype=np.int64)
    local_offsets[:, local_dim] = local_start
    return _Part(tensor, shape, dtype, pos, offsets, lengths, local_offsets)


def _replicated(buffer: str, tensor: str, shape: Sequence[int], dtype: str, num_pos: int) -> _Param:
    return _Param(buffer, np.asarray(shape, dtype=np.int64), dtype,
                  (_part(tensor, shape, dtype, np.arange(num_pos)),))


def _split(buffer: str, tensor: str, shape: Sequence[int], dtype: str, shard: np.ndarray,
           num_shards: int, dim: int) -> _Param:
    """A tensor split evenly along ``dim``; position ``p`` holds shard ``shard[p]``."""
    part = shape[dim] // num_shards
    local = list(shape)
    local[dim] = part
    return _Param(buffer, np.asarray(local, dtype=np.int64), dtype,
                  (_part(tensor, shape, dtype, np.arange(shard.size), dim, shard * part, part, dim),))


def _fused_rows(buffer: str, tensors: Sequence[tuple[str, Sequence[int]]], dtype: str,
                shard: np.ndarray, num_shards: int, dim: int = 0) -> _Param:
    """Tensors each split evenly along ``dim``, their shards stacked along ``dim`` in one
    buffer (``[gate_i; up_i]``, ``[q_a; kv_a]``)."""
    parts, at = [], 0
    pos = np.arange(shard.size)
    for name, shape in tensors:
        part = shape[dim] // num_shards
        parts.append(_part(name, shape, dtype, pos, dim, shard * part, part, dim, at))
        at += part
    local = list(tensors[0][1])
    local[dim] = at
    return _Param(buffer, np.asarray(local, dtype=np.int64), dtype, tuple(parts))


def _vocab(buffer: str, tensor: str, c: ModelConfig, tp: int, divisor: int, num_pos: int) -> _Param:
    padded = -(-c.vocab_size // divisor) * divisor
    if padded % tp:
        raise ValueError(
            f"model {c.name!r}: padded vocab {padded} (vocab {c.vocab_size} padded to a multiple of "
            f"{divisor}) does not split evenly over tp={tp}"
        )
    per = padded // tp
    tp_rank = np.arange(num_pos) % tp
    shape = (c.vocab_size, c.hidden_size)
    return _Param(buffer, np.asarray([per, c.hidden_size], dtype=np.int64), c.dtype,
                  (_part(tensor, shape, c.dtype, np.arange(num_pos), 0, tp_rank * per, per),))


def _emit(b: LayoutBuilder, params: Sequence[_Param], buffer_prefix: str, tensor_prefix: str,
          ranks: np.ndarray) -> None:
    """Declare every parameter on ``ranks`` (indexed by group position) and its pieces."""
    for prm in params:
        ids = b.buffers(buffer_prefix + prm.buffer, ranks, prm.shape, prm.dtype)
        for p in prm.parts:
            t = b.tensor(tensor_prefix + p.tensor, p.shape, p.dtype)
            b.pieces(t, ids[p.pos], p.offsets, p.lengths, p.local_offsets)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


# ---- Megatron-core -------------------------------------------------------------------------
def _megatron_attention(c: ModelConfig, tp: int, n: int) -> list[_Param]:
    h, dt = c.hidden_size, c.dtype
    tp_rank = np.arange(n) % tp
    a, sa = "self_attn.", "self_attention."
    _require(c.num_heads % tp == 0,
             f"model {c.name!r}: {c.num_heads} attention heads do not split over tp={tp}")
    if c.is_mla:
        out = [_replicated("input_layernorm.weight", "input_layernorm.weight", (h,), dt, n)]
        if c.q_lora_rank is None:
            out.append(_split(sa + "linear_q_proj.weight", a + "q_proj.weight",
                              (c.num_heads * c.qk_head_dim, h), dt, tp_rank, tp, 0))
        else:
            out += [
                _replicated(sa + "linear_q_down_proj.weight", a + "q_a_proj.weight",
                            (c.q_lora_rank, h), dt, n),
                _replicated(sa + "linear_q_up_proj.layer_norm_weight", a + "q_a_layernorm.weight",
                            (c.q_lora_rank,), dt, n),
                _split(sa + "linear_q_up_proj.weight", a + "q_b_proj.weight",
                       (c.num_heads * c.qk_head_dim, c.q_lora_rank), dt, tp_rank, tp, 0),
            ]
        out += [
            _replicated(sa + "linear_kv_down_proj.weight", a + "kv_a_proj_with_mqa.weight",
                        (c.kv_lora_rank + c.qk_rope_head_dim, h), dt, n),
            _replicated(sa + "linear_kv_up_proj.layer_norm_weight", a + "kv_a_layernorm.weight",
                        (c.kv_lora_rank,), dt, n),
            _split(sa + "linear_kv_up_proj.weight", a + "kv_b_proj.weight",
                   (c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), dt, tp_rank, tp, 0),
            _split(sa + "linear_proj.weight", a + "o_proj.weight",
                   (h, c.num_heads * c.v_head_dim), dt, tp_rank, tp, 1),
        ]
        return out
    groups, hd = c.num_kv_heads, c.head_dim
    _require(groups % tp == 0,
             f"model {c.name!r}: Megatron-core splits the {groups} kv heads (query groups) over "
             f"tp={tp} and refuses tp that does not divide them (no kv-head replication)")
    local_groups, per_group = groups // tp, c.num_heads // groups
    stride = (per_group + 2) * hd  # one group's rows in linear_qkv: its q heads, k, v
    pos = np.repeat(np.arange(n), local_groups)
    local_group = np.tile(np.arange(local_groups), n)
    group = tp_rank[pos] * local_groups + local_group
    base = local_group * stride
    q = _part(a + "q_proj.weight", (c.num_heads * hd, h), dt, pos, 0, group * per_group * hd,
              per_group * hd, 0, base)
    k = _part(a + "k_proj.weight", (groups * hd, h), dt, pos, 0, group * hd, hd, 0, base + per_group * hd)
    v = _part(a + "v_proj.weight", (groups * hd, h), dt, pos, 0, group * hd, hd, 0,
              base + (per_group + 1) * hd)
    out = [
        _replicated(sa + "linear_qkv.layer_norm_weight", "input_layernorm.weight", (h,), dt, n),
        _Param(sa + "linear_qkv.weight", np.asarray([local_groups * stride, h]), dt, (q, k, v)),
        _split(sa + "linear_proj.weight", a + "o_proj.weight", (h, c.num_heads * hd), dt, tp_rank, tp, 1),
    ]
    if c.qk_norm:
        out += [_replicated(sa + "q_layernorm.weight", a + "q_norm.weight", (hd,), dt, n),
                _replicated(sa + "k_layernorm.weight", a + "k_norm.weight", (hd,), dt, n)]
    return out


def _megatron_mlp(c: ModelConfig, par: TrainingParallelism, n: int, moe: bool) -> list[_Param]:
    h, dt, tp, ep = c.hidden_size, c.dtype, par.tp, par.ep
    tp_rank = np.arange(n) % tp
    m = "mlp."
    if not moe:
        i = c.intermediate_size
        _require(i % tp == 0, f"model {c.name!r}: intermediate size {i} does not split over tp={tp}")
        return [
            _replicated("mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight", (h,), dt, n),
            _fused_rows("mlp.linear_fc1.weight", [(m + "gate_proj.weight", (i, h)), (m + "up_proj.weight", (i, h))],
                        dt, tp_rank, tp),
            _split("mlp.linear_fc2.weight", m + "down_proj.weight", (h, i), dt, tp_rank, tp, 1),
        ]
    e, im = c.num_experts, c.moe_intermediate_size
    _require(e % ep == 0, f"model {c.name!r}: Megatron needs ep={ep} to divide the {e} experts")
    local, ep_rank, pos = e // ep, np.arange(n) % ep, np.arange(n)
    out = [
        _replicated("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", (h,), dt, n),
        _replicated("mlp.router.weight", m + "gate.weight", (e, h), dt, n),
    ]
    if c.router_bias:
        out.append(_replicated("mlp.router.expert_bias", m + "gate.e_score_correction_bias", (e,), "float32", n))
    fc1 = tuple(
        _part(m + f"experts.{which}_proj.weight", (e, im, h), dt, pos, 0, ep_rank * local, local, 1, at)
        for which, at in (("gate", 0), ("up", im))
    )
    fc2 = _part(m + "experts.down_proj.weight", (e, h, im), dt, pos, 0, ep_rank * local, local)
    out += [_Param("mlp.experts.linear_fc1.weight", np.asarray([local, 2 * im, h]), dt, fc1),
            _Param("mlp.experts.linear_fc2.weight", np.asarray([local, h, im]), dt, (fc2,))]
    if c.num_shared_experts:
        s = c.shared_intermediate_size
        _require(s % tp == 0, f"model {c.name!r}: shared-expert size {s} does not split over tp={tp}")
        out += [
            _fused_rows("mlp.shared_experts.linear_fc1.weight",
                        [(m + "shared_experts.gate_proj.weight", (s, h)),
                         (m + "shared_experts.up_proj.weight", (s, h))], dt, tp_rank, tp),
            _split("mlp.shared_experts.linear_fc2.weight", m + "shared_experts.down_proj.weight",
                   (h, s), dt, tp_rank, tp, 1),
        ]
    return out


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Global layer indices of each pipeline stage: the first ``num_layers % pp`` stages
    take one layer more; stages may be empty when ``pp > num_layers``."""
    base, extra = divmod(num_layers, pp)
    counts = [base + (s < extra) for s in range(pp)]
    starts = np.concatenate([[0], np.cumsum(counts)])
    return [range(int(starts[s]), int(starts[s + 1])) for s in range(pp)]


def megatron_layout(config: ModelConfig | str, par: TrainingParallelism | str, first_rank: int = 0,
                    num_layers: int | None = None) -> Layout:
    """Megatron-core training layout of ``config`` (see the module docstring for the rules).

    ``rank = first_rank + tp_rank + tp * (dp_rank + dp * pp_rank)``. ``num_layers`` cuts the
    model to its first layers (embeddings and head kept).
    """
    c = get_model(config).with_layers(num_layers)
    par = _as_training(par)
    first_rank = _check_first_rank(first_rank)
    n = par.tp * par.dp
    grid = first_rank + np.arange(par.world_size, dtype=np.int64).reshape(par.pp, n)
    attention = _megatron_attention(c, par.tp, n)
    mlp = {moe: _megatron_mlp(c, par, n, moe)
           for moe in {c.is_moe_layer(i) for i in range(c.num_layers)}}
    b = LayoutBuilder()
    embedding = _vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight", c, par.tp,
                       MEGATRON_VOCAB_DIVISOR * par.tp, n)
    _emit(b, [embedding], "", "", grid[0])
    for stage, layers in enumerate(stage_layers(c.num_layers, par.pp)):
        for local, layer in enumerate(layers):
            _emit(b, attention + mlp[c.is_moe_layer(layer)], f"decoder.layers.{local}.",
                  f"model.layers.{layer}.", grid[stage])
    last = [_replicated("decoder.final_layernorm.weight", "model.norm.weight", (c.hidden_size,), c.dtype, n)]
    if not c.tie_word_embeddings:
        last.append(_vocab("output_layer.weight", "lm_head.weight", c, par.tp,
                           MEGATRON_VOCAB_DIVISOR * par.tp, n))
    elif par.pp > 1:
        # Tied: the last stage keeps its own copy of the word embeddings as the output layer.
        last.append(_vocab("output_layer.weight", "model.embed_tokens.weight", c, par.tp,
                           MEGATRON_VOCAB_DIVISOR * par.tp, n))
    _emit(b, last, "", "", grid[-1])
    return b.build()


# ---- vLLM ----------------------------------------------------------------------------------
def _vllm_attention(c: ModelConfig, tp: int, n: int) -> list[_Param]:
    h, dt = c.hidden_size, c.dtype
    tp_rank = np.arange(n) % tp
    a = "self_attn."
    _require(c.num_heads % tp == 0,
             f"model {c.name!r}: {c.num_heads} attention heads do not split over tp={tp}")
    out = [_replicated("input_layernorm.weight", "input_layernorm.weight", (h,), dt, n)]
    if c.is_mla:
        kv_a = (a + "kv_a_proj_with_mqa.weight", (c.kv_lora_rank + c.qk_rope_head_dim, h))
        if c.q_lora_rank is None:
            out += [_split(a + "q_proj.weight", a + "q_proj.weight", (c.num_heads * c.qk_head_dim, h), dt,
                           tp_rank, tp, 0),
                    _replicated(kv_a[0], kv_a[0], kv_a[1], dt, n)]
        else:
            out += [
                _fused_rows(a + "fused_qkv_a_proj.weight", [(a + "q_a_proj.weight", (c.q_lora_rank, h)), kv_a],
                            dt, np.zeros(n, dtype=np.int64), 1),
                _replicated(a + "q_a_layernorm.weight", a + "q_a_layernorm.weight", (c.q_lora_rank,), dt, n),
                _split(a + "q_b_proj.weight", a + "q_b_proj.weight", (c.num_heads * c.qk_head_dim, c.q_lora_rank),
                       dt, tp_rank, tp, 0),
            ]
        out += [
            _replicated(a + "kv_a_layernorm.weight", a + "kv_a_layernorm.weight", (c.kv_lora_rank,), dt, n),
            _split(a + "kv_b_proj.weight", a + "kv_b_proj.weight",
                   (c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), dt, tp_rank, tp, 0),
            _split(a + "o_proj.weight", a + "o_proj.weight", (h, c.num_heads * c.v_head_dim), dt, tp_rank, tp, 1),
        ]
        return out
    kv, hd = c.num_kv_heads, c.head_dim
    if tp >= kv:
        _require(tp % kv == 0, f"model {c.name!r}: tp={tp} must be a multiple of the {kv} kv heads")
        local_kv, kv_start = 1, tp_rank // (tp // kv)  # each kv head replicated tp/kv times
    else:
        _require(kv % tp == 0, f"model {c.name!r}: {kv} kv heads do not split over tp={tp}")
        local_kv, kv_start = kv // tp, tp_rank * (kv // tp)
    local_q = c.num_heads // tp
    pos = np.arange(n)
    q = _part(a + "q_proj.weight", (c.num_heads * hd, h), dt, pos, 0, tp_rank * local_q * hd, local_q * hd)
    k = _part(a + "k_proj.weight", (kv * hd, h), dt, pos, 0, kv_start * hd, local_kv * hd, 0, local_q * hd)
    v = _part(a + "v_proj.weight", (kv * hd, h), dt, pos, 0, kv_start * hd, local_kv * hd, 0,
              (local_q + local_kv) * hd)
    out += [
        _Param(a + "qkv_proj.weight", np.asarray([(local_q + 2 * local_kv) * hd, h]), dt, (q, k, v)),
        _split(a + "o_proj.weight", a + "o_proj.weight", (h, c.num_heads * hd), dt, tp_rank, tp, 1),
    ]
    if c.qk_norm:
        out += [_replicated(a + "q_norm.weight", a + "q_norm.weight", (hd,), dt, n),
                _replicated(a + "k_norm.weight", a + "k_norm.weight", (hd,), dt, n)]
    return out


def _vllm_mlp(c: ModelConfig, par: InferenceParallelism, n: int, moe: bool, flatten_moe_tp: bool) -> list[_Param]:
    h, dt, tp, ep = c.hidden_size, c.dtype, par.tp, par.ep
    tp_rank, pos = np.arange(n) % tp, np.arange(n)
    m = "mlp."
    out = [_replicated("post_attention_layernorm.weight", "post_attention_layernorm.weight", (h,), dt, n)]
    if not moe:
        i = c.intermediate_size
        _require(i % tp == 0, f"model {c.name!r}: intermediate size {i} does not split over tp={tp}")
        return [*out,
                _fused_rows(m + "gate_up_proj.weight", [(m + "gate_proj.weight", (i, h)), (m + "up_proj.weight", (i, h))],
                            dt, tp_rank, tp),
                _split(m + "down_proj.weight", m + "down_proj.weight", (h, i), dt, tp_rank, tp, 1)]
    e, im = c.num_experts, c.moe_intermediate_size
    out.append(_replicated(m + "gate.weight", m + "gate.weight", (e, h), dt, n))
    if c.router_bias:
        out.append(_replicated(m + "gate.e_score_correction_bias", m + "gate.e_score_correction_bias", (e,),
                               "float32", n))
    names = [m + f"experts.{w}_proj.weight" for w in ("gate", "up", "down")]
    if ep > 1:
        _require(e >= ep, f"model {c.name!r}: ep={ep} exceeds the {e} experts")
        ep_rank = pos % ep
        base, extra = divmod(e, ep)  # vLLM's linear expert map: the first e % ep ranks take one more
        count = base + (ep_rank < extra)
        start = ep_rank * base + np.minimum(ep_rank, extra)
        w13 = tuple(_part(nm, (e, im, h), dt, pos, 0, start, count, 1, at)
                    for nm, at in ((names[0], 0), (names[1], im)))
        w2 = _part(names[2], (e, h, im), dt, pos, 0, start, count)
        shapes13 = np.stack([count, np.full(n, 2 * im), np.full(n, h)], axis=1)
        shapes2 = np.stack([count, np.full(n, h), np.full(n, im)], axis=1)
    else:
        moe_tp = n if flatten_moe_tp else tp
        _require(im % moe_tp == 0,
                 f"model {c.name!r}: expert intermediate size {im} does not split over {moe_tp} ranks")
        local = im // moe_tp
        moe_rank = pos % moe_tp
        w13 = tuple(_part(nm, (e, im, h), dt, pos, 1, moe_rank * local, local, 1, at)
                    for nm, at in ((names[0], 0), (names[1], local)))
        w2 = _part(names[2], (e, h, im), dt, pos, 2, moe_rank * local, local, 2)
        shapes13, shapes2 = np.asarray([e, 2 * local, h]), np.asarray([e, h, local])
    out += [_Param(m + "experts.w13_weight", shapes13, dt, w13), _Param(m + "experts.w2_weight", shapes2, dt, (w2,))]
    if c.num_shared_experts:
        s = c.shared_intermediate_size
        _require(s % tp == 0, f"model {c.name!r}: shared-expert size {s} does not split over tp={tp}")
        out += [
            _fused_rows(m + "shared_experts.gate_up_proj.weight",
                        [(m + "shared_experts.gate_proj.weight", (s, h)),
                         (m + "shared_experts.up_proj.weight", (s, h))], dt, tp_rank, tp),
            _split(m + "shared_experts.down_proj.weight", m + "shared_experts.down_proj.weight",
                   (h, s), dt, tp_rank, tp, 1),
        ]
    return out


def vllm_layout(config: ModelConfig | str, par: InferenceParallelism | str, first_rank: int = 0,
                num_layers: int | None = None, flatten_moe_tp: bool = False) -> Layout:
    """vLLM inference layout of ``config`` (see the module docstring for the rules).

    ``rank = first_rank + tp_rank + tp * dp_rank``. With ``ep == 1`` experts are TP-sharded
    over ``tp`` (independent engines per DP replica) or, with ``flatten_moe_tp``, over all
    ``tp * dp`` ranks. ``num_layers`` cuts the model to its first layers.
    """
    c = get_model(config).with_layers(num_layers)
    par = _as_inference(par)
    first_rank = _check_first_rank(first_rank)
    n = par.world_size
    ranks = first_rank + np.arange(n, dtype=np.int64)
    attention = _vllm_attention(c, par.tp, n)
    mlp = {moe: _vllm_mlp(c, par, n, moe, flatten_moe_tp)
           for moe in {c.is_moe_layer(i) for i in range(c.num_layers)}}
    b = LayoutBuilder()
    params = [_vocab("model.embed_tokens.weight", "model.embed_tokens.weight", c, par.tp, VLLM_VOCAB_PADDING, n)]
    _emit(b, params, "", "", ranks)
    for layer in range(c.num_layers):
        prefix = f"model.layers.{layer}."
        _emit(b, attention + mlp[c.is_moe_layer(layer)], prefix, prefix, ranks)
    last = [_replicated("model.norm.weight", "model.norm.weight", (c.hidden_size,), c.dtype, n)]
    if not c.tie_word_embeddings:
        last.append(_vocab("lm_head.weight", "lm_head.weight", c, par.tp, VLLM_VOCAB_PADDING, n))
    _emit(b, last, "", "", ranks)
    return b.build()


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
