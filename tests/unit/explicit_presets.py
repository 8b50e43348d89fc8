"""The model presets as explicit piece lists, built directly (no rules): the oracle the rules
(``layout.symbolic_presets``, which ``megatron_layout`` and ``vllm_layout`` now build from)
are checked against, row for row. This is the library's explicit constructor as it was
before the presets were kept as rules (issue 40); the rules' semantics are in the
docstring of ``layout.presets``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from elastic_refit.layout.core import Layout, LayoutBuilder
from elastic_refit.layout.models import ModelConfig, get_model
from elastic_refit.layout.parallelism import (
    MEGATRON_VOCAB_DIVISOR,
    VLLM_VOCAB_PADDING,
    InferenceParallelism,
    TrainingParallelism,
    _as_inference,
    _as_training,
    _check_first_rank,
    stage_layers,
)

__all__ = ["megatron_explicit", "vllm_explicit"]


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



def megatron_explicit(config: ModelConfig | str, par: TrainingParallelism | str, first_rank: int = 0,
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


def vllm_explicit(config: ModelConfig | str, par: InferenceParallelism | str, first_rank: int = 0,
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
