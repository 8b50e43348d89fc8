"""The model presets as rules: ``megatron_symbolic`` and ``vllm_symbolic``.

The layouts ``presets.megatron_layout`` and ``presets.vllm_layout`` build (their
``to_layout()``; see that module for the frameworks' rules), kept as ``SymbolicLayout``
rules: per parameter of a kind of layer, one buffer rule and one piece rule per logical
tensor in it, over the group's mesh (``tp * dp`` positions from the stage's first rank). So
the layout is O(tensors) whatever the ranks: ``to_layout()`` equals the presets built piece
by piece (``tests/unit/explicit_presets.py``, the oracle) row for row, and one rank derives
its own pieces alone (``layout_of_ranks``).

The group's meshes: ``(n,)`` for replicated tensors; ``(n / tp, tp)`` (axis 1 = tp rank)
for TP splits, which are ``block`` splits of ``size / tp`` rows as the explicit presets
cut them; ``(n / ep, ep)`` for experts; ``(n / tp, kv, tp / kv)`` for vLLM kv heads
replicated over ``tp / kv`` ranks. Megatron's fused QKV holds, per local kv group ``j``,
that group's q heads, k and v: one rule per ``j`` (``block`` then ``slice``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from elastic_refit.layout.models import ModelConfig, get_model
from elastic_refit.layout.parallelism import (
    MEGATRON_VOCAB_DIVISOR,
    VLLM_VOCAB_PADDING,
    InferenceParallelism,
    TrainingParallelism,
    _as_inference,
    _as_training,
    _check_first_rank,
    _require,
    stage_layers,
)
from elastic_refit.layout.symbolic import Mesh, Split, SymbolicLayout
from elastic_refit.layout.symbolic_build import SymbolicBuilder

__all__ = ["megatron_symbolic", "vllm_symbolic"]


@dataclass(frozen=True, slots=True)
class _Part:
    tensor: str
    shape: tuple[int, ...]
    dtype: str
    mesh: Mesh  # from rank 0 of the group
    splits: tuple[Split, ...] = ()
    local_dim: int = 0
    local_start: int = 0


@dataclass(frozen=True, slots=True)
class _Param:
    buffer: str
    mesh: Mesh
    shape: tuple[int, ...]  # virtual shape: the buffer's local shape under ``splits``
    dtype: str
    parts: tuple[_Part, ...]
    splits: tuple[Split, ...] = ()


def _flat(n: int) -> Mesh:
    return Mesh((n,))


def _grid(n: int, k: int) -> Mesh:
    """``(n / k, k)``: axis 1 is ``pos % k`` (tp rank, ep rank)."""
    return Mesh((n // k, k), 0, (k, 1))


def _block(dim: int, size: int, axis: int = 1) -> Split:
    return Split("block", dim, axis, size)


def _replicated(buffer: str, tensor: str, shape: Sequence[int], dtype: str, n: int) -> _Param:
    shape = tuple(shape)
    return _Param(buffer, _flat(n), shape, dtype, (_Part(tensor, shape, dtype, _flat(n)),))


def _split(buffer: str, tensor: str, shape: Sequence[int], dtype: str, tp: int, n: int, dim: int) -> _Param:
    """Split evenly along ``dim`` over the tp ranks."""
    shape = tuple(shape)
    part = shape[dim] // tp
    local = list(shape)
    local[dim] = part
    return _Param(buffer, _flat(n), tuple(local), dtype,
                  (_Part(tensor, shape, dtype, _grid(n, tp), (_block(dim, part),), dim),))


def _fused_rows(buffer: str, tensors: Sequence[tuple[str, Sequence[int]]], dtype: str, tp: int, n: int) -> _Param:
    """Tensors each split over tp along dim 0, their shards stacked in one buffer."""
    parts, at = [], 0
    for name, shape in tensors:
        part = shape[0] // tp
        splits = (_block(0, part),) if tp > 1 else ()
        parts.append(_Part(name, tuple(shape), dtype, _grid(n, tp) if tp > 1 else _flat(n), splits, 0, at))
        at += part
    return _Param(buffer, _flat(n), (at, *tuple(tensors[0][1])[1:]), dtype, tuple(parts))


def _vocab(buffer: str, tensor: str, c: ModelConfig, tp: int, divisor: int, n: int) -> _Param:
    padded = -(-c.vocab_size // divisor) * divisor
    _require(padded % tp == 0, f"model {c.name!r}: padded vocab {padded} (vocab {c.vocab_size} padded to a multiple "
                               f"of {divisor}) does not split evenly over tp={tp}")
    per = padded // tp
    shape = (c.vocab_size, c.hidden_size)
    return _Param(buffer, _flat(n), (per, c.hidden_size), c.dtype,
                  (_Part(tensor, shape, c.dtype, _grid(n, tp), (_block(0, per),)),))


@functools.lru_cache(maxsize=4096)
def _at(mesh: Mesh, base: int) -> Mesh:
    """``mesh`` from rank ``base`` (every layer of a stage places the same few meshes there)."""
    return mesh.shifted(-base)


def _emit(b: SymbolicBuilder, params: Sequence[_Param], buffer_prefix: str, tensor_prefix: str, base: int) -> None:
    for prm in params:
        b.buffer(buffer_prefix + prm.buffer, _at(prm.mesh, base), prm.shape, prm.dtype, prm.splits)
        for p in prm.parts:
            b.tensor(tensor_prefix + p.tensor, p.shape, p.dtype)
            b.rule(tensor_prefix + p.tensor, buffer_prefix + prm.buffer, _at(p.mesh, base), p.splits,
                   p.local_dim, p.local_start)


# ---- Megatron-core -------------------------------------------------------------------------
def _megatron_attention(c: ModelConfig, tp: int, n: int) -> list[_Param]:
    h, dt = c.hidden_size, c.dtype
    a, sa = "self_attn.", "self_attention."
    _require(c.num_heads % tp == 0, f"model {c.name!r}: {c.num_heads} attention heads do not split over tp={tp}")
    if c.is_mla:
        out = [_replicated("input_layernorm.weight", "input_layernorm.weight", (h,), dt, n)]
        if c.q_lora_rank is None:
            out.append(_split(sa + "linear_q_proj.weight", a + "q_proj.weight", (c.num_heads * c.qk_head_dim, h), dt,
                              tp, n, 0))
        else:
            out += [
                _replicated(sa + "linear_q_down_proj.weight", a + "q_a_proj.weight", (c.q_lora_rank, h), dt, n),
                _replicated(sa + "linear_q_up_proj.layer_norm_weight", a + "q_a_layernorm.weight", (c.q_lora_rank,),
                            dt, n),
                _split(sa + "linear_q_up_proj.weight", a + "q_b_proj.weight",
                       (c.num_heads * c.qk_head_dim, c.q_lora_rank), dt, tp, n, 0),
            ]
        return out + [
            _replicated(sa + "linear_kv_down_proj.weight", a + "kv_a_proj_with_mqa.weight",
                        (c.kv_lora_rank + c.qk_rope_head_dim, h), dt, n),
            _replicated(sa + "linear_kv_up_proj.layer_norm_weight", a + "kv_a_layernorm.weight", (c.kv_lora_rank,),
                        dt, n),
            _split(sa + "linear_kv_up_proj.weight", a + "kv_b_proj.weight",
                   (c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), dt, tp, n, 0),
            _split(sa + "linear_proj.weight", a + "o_proj.weight", (h, c.num_heads * c.v_head_dim), dt, tp, n, 1),
        ]
    groups, hd = c.num_kv_heads, c.head_dim
    _require(groups % tp == 0, f"model {c.name!r}: Megatron-core splits the {groups} kv heads (query groups) over "
                               f"tp={tp} and refuses tp that does not divide them (no kv-head replication)")
    local_groups, per_group = groups // tp, c.num_heads // groups
    stride = (per_group + 2) * hd  # one group's rows in linear_qkv: its q heads, k, v
    parts = []
    for j in range(local_groups):  # local kv group j of every tp rank: group tp_rank * local_groups + j
        for name, rows, rows_total, at in ((a + "q_proj.weight", per_group * hd, c.num_heads * hd, 0),
                                           (a + "k_proj.weight", hd, groups * hd, per_group * hd),
                                           (a + "v_proj.weight", hd, groups * hd, (per_group + 1) * hd)):
            parts.append(_Part(name, (rows_total, h), dt, _grid(n, tp),
                               (_block(0, local_groups * rows), Split("slice", 0, -1, j * rows, rows)), 0,
                               j * stride + at))
    out = [
        _replicated(sa + "linear_qkv.layer_norm_weight", "input_layernorm.weight", (h,), dt, n),
        _Param(sa + "linear_qkv.weight", _flat(n), (local_groups * stride, h), dt, tuple(parts)),
        _split(sa + "linear_proj.weight", a + "o_proj.weight", (h, c.num_heads * hd), dt, tp, n, 1),
    ]
    if c.qk_norm:
        out += [_replicated(sa + "q_layernorm.weight", a + "q_norm.weight", (hd,), dt, n),
                _replicated(sa + "k_layernorm.weight", a + "k_norm.weight", (hd,), dt, n)]
    return out


def _megatron_mlp(c: ModelConfig, par: TrainingParallelism, n: int, moe: bool) -> list[_Param]:
    h, dt, tp, ep = c.hidden_size, c.dtype, par.tp, par.ep
    m = "mlp."
    if not moe:
        i = c.intermediate_size
        _require(i % tp == 0, f"model {c.name!r}: intermediate size {i} does not split over tp={tp}")
        return [
            _replicated("mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight", (h,), dt, n),
            _fused_rows("mlp.linear_fc1.weight", [(m + "gate_proj.weight", (i, h)), (m + "up_proj.weight", (i, h))],
                        dt, tp, n),
            _split("mlp.linear_fc2.weight", m + "down_proj.weight", (h, i), dt, tp, n, 1),
        ]
    e, im = c.num_experts, c.moe_intermediate_size
    _require(e % ep == 0, f"model {c.name!r}: Megatron needs ep={ep} to divide the {e} experts")
    local = e // ep
    out = [
        _replicated("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", (h,), dt, n),
        _replicated("mlp.router.weight", m + "gate.weight", (e, h), dt, n),
    ]
    if c.router_bias:
        out.append(_replicated("mlp.router.expert_bias", m + "gate.e_score_correction_bias", (e,), "float32", n))
    experts = _grid(n, ep)
    fc1 = tuple(_Part(m + f"experts.{which}_proj.weight", (e, im, h), dt, experts, (_block(0, local),), 1, at)
                for which, at in (("gate", 0), ("up", im)))
    fc2 = _Part(m + "experts.down_proj.weight", (e, h, im), dt, experts, (_block(0, local),))
    out += [_Param("mlp.experts.linear_fc1.weight", _flat(n), (local, 2 * im, h), dt, fc1),
            _Param("mlp.experts.linear_fc2.weight", _flat(n), (local, h, im), dt, (fc2,))]
    if c.num_shared_experts:
        s = c.shared_intermediate_size
        _require(s % tp == 0, f"model {c.name!r}: shared-expert size {s} does not split over tp={tp}")
        out += [
            _fused_rows("mlp.shared_experts.linear_fc1.weight",
                        [(m + "shared_experts.gate_proj.weight", (s, h)), (m + "shared_experts.up_proj.weight", (s, h))],
                        dt, tp, n),
            _split("mlp.shared_experts.linear_fc2.weight", m + "shared_experts.down_proj.weight", (h, s), dt, tp, n, 1),
        ]
    return out


def megatron_symbolic(config: ModelConfig | str, par: TrainingParallelism | str, first_rank: int = 0,
                      num_layers: int | None = None) -> SymbolicLayout:
    """``presets.megatron_layout`` as rules (same arguments, same pieces)."""
    c = get_model(config).with_layers(num_layers)
    par = _as_training(par)
    first_rank = _check_first_rank(first_rank)
    n = par.tp * par.dp
    attention = _megatron_attention(c, par.tp, n)
    mlp = {moe: _megatron_mlp(c, par, n, moe) for moe in {c.is_moe_layer(i) for i in range(c.num_layers)}}
    b = SymbolicBuilder()
    vocab = MEGATRON_VOCAB_DIVISOR * par.tp
    _emit(b, [_vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight", c, par.tp, vocab, n)], "", "",
          first_rank)
    for stage, layers in enumerate(stage_layers(c.num_layers, par.pp)):
        for local, layer in enumerate(layers):
            _emit(b, attention + mlp[c.is_moe_layer(layer)], f"decoder.layers.{local}.", f"model.layers.{layer}.",
                  first_rank + stage * n)
    last = [_replicated("decoder.final_layernorm.weight", "model.norm.weight", (c.hidden_size,), c.dtype, n)]
    if not c.tie_word_embeddings:
        last.append(_vocab("output_layer.weight", "lm_head.weight", c, par.tp, vocab, n))
    elif par.pp > 1:  # tied: the last stage keeps its own copy of the word embeddings
        last.append(_vocab("output_layer.weight", "model.embed_tokens.weight", c, par.tp, vocab, n))
    _emit(b, last, "", "", first_rank + (par.pp - 1) * n)
    return b.build()


# ---- vLLM ----------------------------------------------------------------------------------
def _vllm_attention(c: ModelConfig, tp: int, n: int) -> list[_Param]:
    h, dt = c.hidden_size, c.dtype
    a = "self_attn."
    _require(c.num_heads % tp == 0, f"model {c.name!r}: {c.num_heads} attention heads do not split over tp={tp}")
    out = [_replicated("input_layernorm.weight", "input_layernorm.weight", (h,), dt, n)]
    if c.is_mla:
        kv_a = (a + "kv_a_proj_with_mqa.weight", (c.kv_lora_rank + c.qk_rope_head_dim, h))
        if c.q_lora_rank is None:
            out += [_split(a + "q_proj.weight", a + "q_proj.weight", (c.num_heads * c.qk_head_dim, h), dt, tp, n, 0),
                    _replicated(kv_a[0], kv_a[0], kv_a[1], dt, n)]
        else:
            out += [
                _fused_rows(a + "fused_qkv_a_proj.weight", [(a + "q_a_proj.weight", (c.q_lora_rank, h)), kv_a], dt, 1,
                            n),
                _replicated(a + "q_a_layernorm.weight", a + "q_a_layernorm.weight", (c.q_lora_rank,), dt, n),
                _split(a + "q_b_proj.weight", a + "q_b_proj.weight", (c.num_heads * c.qk_head_dim, c.q_lora_rank), dt,
                       tp, n, 0),
            ]
        return out + [
            _replicated(a + "kv_a_layernorm.weight", a + "kv_a_layernorm.weight", (c.kv_lora_rank,), dt, n),
            _split(a + "kv_b_proj.weight", a + "kv_b_proj.weight",
                   (c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), dt, tp, n, 0),
            _split(a + "o_proj.weight", a + "o_proj.weight", (h, c.num_heads * c.v_head_dim), dt, tp, n, 1),
        ]
    kv, hd = c.num_kv_heads, c.head_dim
    if tp >= kv:
        _require(tp % kv == 0, f"model {c.name!r}: tp={tp} must be a multiple of the {kv} kv heads")
        local_kv = 1  # kv head tp_rank // (tp / kv), replicated tp / kv times
        kv_mesh, kv_split = Mesh((n // tp, kv, tp // kv), 0, (tp, tp // kv, 1)), _block(0, hd)
    else:
        _require(kv % tp == 0, f"model {c.name!r}: {kv} kv heads do not split over tp={tp}")
        local_kv = kv // tp
        kv_mesh, kv_split = _grid(n, tp), _block(0, local_kv * hd)
    local_q = c.num_heads // tp
    q = _Part(a + "q_proj.weight", (c.num_heads * hd, h), dt, _grid(n, tp), (_block(0, local_q * hd),))
    k = _Part(a + "k_proj.weight", (kv * hd, h), dt, kv_mesh, (kv_split,), 0, local_q * hd)
    v = _Part(a + "v_proj.weight", (kv * hd, h), dt, kv_mesh, (kv_split,), 0, (local_q + local_kv) * hd)
    out += [
        _Param(a + "qkv_proj.weight", _flat(n), ((local_q + 2 * local_kv) * hd, h), dt, (q, k, v)),
        _split(a + "o_proj.weight", a + "o_proj.weight", (h, c.num_heads * hd), dt, tp, n, 1),
    ]
    if c.qk_norm:
        out += [_replicated(a + "q_norm.weight", a + "q_norm.weight", (hd,), dt, n),
                _replicated(a + "k_norm.weight", a + "k_norm.weight", (hd,), dt, n)]
    return out


def _vllm_experts(c: ModelConfig, par: InferenceParallelism, n: int, flatten_moe_tp: bool) -> list[_Param]:
    h, dt, ep = c.hidden_size, c.dtype, par.ep
    e, im = c.num_experts, c.moe_intermediate_size
    names = [f"mlp.experts.{w}_proj.weight" for w in ("gate", "up", "down")]
    if ep > 1:
        _require(e >= ep, f"model {c.name!r}: ep={ep} exceeds the {e} experts")
        mesh, split = _grid(n, ep), Split("balanced", 0, 1)  # the first e % ep ranks take one more
        w13 = tuple(_Part(nm, (e, im, h), dt, mesh, (split,), 1, at) for nm, at in ((names[0], 0), (names[1], im)))
        w2 = _Part(names[2], (e, h, im), dt, mesh, (split,))
        return [_Param("mlp.experts.w13_weight", mesh, (e, 2 * im, h), dt, w13, (split,)),
                _Param("mlp.experts.w2_weight", mesh, (e, h, im), dt, (w2,), (split,))]
    moe_tp = n if flatten_moe_tp else par.tp
    _require(im % moe_tp == 0, f"model {c.name!r}: expert intermediate size {im} does not split over {moe_tp} ranks")
    local = im // moe_tp
    mesh = _grid(n, moe_tp)
    w13 = tuple(_Part(nm, (e, im, h), dt, mesh, (_block(1, local),), 1, at)
                for nm, at in ((names[0], 0), (names[1], local)))
    w2 = _Part(names[2], (e, h, im), dt, mesh, (_block(2, local),), 2)
    return [_Param("mlp.experts.w13_weight", _flat(n), (e, 2 * local, h), dt, w13),
            _Param("mlp.experts.w2_weight", _flat(n), (e, h, local), dt, (w2,))]


def _vllm_mlp(c: ModelConfig, par: InferenceParallelism, n: int, moe: bool, flatten_moe_tp: bool) -> list[_Param]:
    h, dt, tp = c.hidden_size, c.dtype, par.tp
    m = "mlp."
    out = [_replicated("post_attention_layernorm.weight", "post_attention_layernorm.weight", (h,), dt, n)]
    if not moe:
        i = c.intermediate_size
        _require(i % tp == 0, f"model {c.name!r}: intermediate size {i} does not split over tp={tp}")
        return [*out,
                _fused_rows(m + "gate_up_proj.weight", [(m + "gate_proj.weight", (i, h)), (m + "up_proj.weight", (i, h))],
                            dt, tp, n),
                _split(m + "down_proj.weight", m + "down_proj.weight", (h, i), dt, tp, n, 1)]
    e = c.num_experts
    out.append(_replicated(m + "gate.weight", m + "gate.weight", (e, h), dt, n))
    if c.router_bias:
        out.append(_replicated(m + "gate.e_score_correction_bias", m + "gate.e_score_correction_bias", (e,), "float32",
                               n))
    out += _vllm_experts(c, par, n, flatten_moe_tp)
    if c.num_shared_experts:
        s = c.shared_intermediate_size
        _require(s % tp == 0, f"model {c.name!r}: shared-expert size {s} does not split over tp={tp}")
        out += [
            _fused_rows(m + "shared_experts.gate_up_proj.weight",
                        [(m + "shared_experts.gate_proj.weight", (s, h)), (m + "shared_experts.up_proj.weight", (s, h))],
                        dt, tp, n),
            _split(m + "shared_experts.down_proj.weight", m + "shared_experts.down_proj.weight", (h, s), dt, tp, n, 1),
        ]
    return out


def vllm_symbolic(config: ModelConfig | str, par: InferenceParallelism | str, first_rank: int = 0,
                  num_layers: int | None = None, flatten_moe_tp: bool = False) -> SymbolicLayout:
    """``presets.vllm_layout`` as rules (same arguments, same pieces)."""
    c = get_model(config).with_layers(num_layers)
    par = _as_inference(par)
    first_rank = _check_first_rank(first_rank)
    n = par.world_size
    attention = _vllm_attention(c, par.tp, n)
    mlp = {moe: _vllm_mlp(c, par, n, moe, flatten_moe_tp) for moe in {c.is_moe_layer(i) for i in range(c.num_layers)}}
    b = SymbolicBuilder()
    _emit(b, [_vocab("model.embed_tokens.weight", "model.embed_tokens.weight", c, par.tp, VLLM_VOCAB_PADDING, n)],
          "", "", first_rank)
    for layer in range(c.num_layers):
        prefix = f"model.layers.{layer}."
        _emit(b, attention + mlp[c.is_moe_layer(layer)], prefix, prefix, first_rank)
    last = [_replicated("model.norm.weight", "model.norm.weight", (c.hidden_size,), c.dtype, n)]
    if not c.tie_word_embeddings:
        last.append(_vocab("lm_head.weight", "lm_head.weight", c, par.tp, VLLM_VOCAB_PADDING, n))
    _emit(b, last, "", "", first_rank)
    return b.build()
