"""Model presets: parameter inventories, Megatron-core and vLLM layouts, parallelism parsing."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from elastic_refit.layout import (
    MODELS,
    InferenceParallelism,
    Layout,
    ModelConfig,
    TrainingParallelism,
    config_from_hf,
    get_model,
    logical_tensors,
    megatron_layout,
    parameter_count,
    parse_parallelism,
    stage_layers,
    vllm_layout,
)

# ---- helpers -------------------------------------------------------------------------------


def uncovered_tensors(layout: Layout) -> list[str]:
    """Tensors whose elements are not all inside the union of the layout's piece boxes.

    Exact: coordinate-compress every dim on the box boundaries, then paint each distinct
    box on the compressed grid (replicas collapse to one box)."""
    missing = []
    order = np.argsort(layout.piece_tensor, kind="stable")
    bounds = np.searchsorted(layout.piece_tensor[order], np.arange(len(layout.tensors) + 1))
    for ti, t in enumerate(layout.tensors):
        rows = order[bounds[ti]:bounds[ti + 1]]
        nd = len(t.shape)
        boxes = np.unique(
            np.concatenate([layout.piece_offsets[rows, :nd], layout.piece_lengths[rows, :nd]], axis=1), axis=0
        )
        if boxes.shape[0] == 0:
            missing.append(t.name)
            continue
        lo, hi = boxes[:, :nd], boxes[:, :nd] + boxes[:, nd:]
        cuts = [np.unique(np.concatenate([[0, t.shape[d]], lo[:, d], hi[:, d]])) for d in range(nd)]
        grid = np.zeros([len(c) - 1 for c in cuts], dtype=bool)
        for b in range(boxes.shape[0]):
            grid[tuple(slice(np.searchsorted(cuts[d], lo[b, d]), np.searchsorted(cuts[d], hi[b, d]))
                       for d in range(nd))] = True
        if not grid.all():
            missing.append(t.name)
    return missing


def overlapping_buffers(layout: Layout) -> list[str]:
    """Buffers in which two pieces' local boxes overlap (exact, vectorised over pieces)."""
    order = np.argsort(layout.piece_buffer, kind="stable")
    buf = layout.piece_buffer[order]
    lo = layout.piece_local_offsets[order]
    hi = lo + layout.piece_local_lengths[order]
    run = np.bincount(buf).max(initial=0)
    bad: set[int] = set()
    for shift in range(1, run):
        same = buf[shift:] == buf[:-shift]
        overlap = same & np.all((lo[shift:] < hi[:-shift]) & (lo[:-shift] < hi[shift:]), axis=1)
        bad.update(int(b) for b in buf[shift:][overlap])
    return [f"rank {layout.buffer(b).rank} {layout.buffer(b).name}" for b in sorted(bad)]


def tensor_values(layout: Layout) -> dict[str, np.ndarray]:
    """Distinct values for every element of every tensor (unique across tensors)."""
    out, at = {}, 0
    for t in layout.tensors:
        out[t.name] = (np.arange(t.numel, dtype=np.float64) + at).reshape(t.shape)
        at += t.numel
    return out


def materialize(layout: Layout) -> dict[tuple[int, str], np.ndarray]:
    """Every buffer filled from its pieces (NaN where no piece writes); fails on overlap."""
    values = tensor_values(layout)
    buffers = {}
    writes = {}
    for i in range(layout.num_buffers):
        buf = layout.buffer(i)
        buffers[buf.rank, buf.name] = np.full(buf.shape, np.nan)
        writes[buf.rank, buf.name] = np.zeros(buf.shape, dtype=np.int64)
    for piece in layout.pieces():
        src = values[piece.tensor][piece.box.slices()]
        key = (piece.rank, piece.buffer)
        buffers[key][piece.local_box.slices()] = src.reshape(piece.local_box.lengths)
        writes[key][piece.local_box.slices()] += 1
    for key, count in writes.items():
        assert count.max(initial=0) <= 1, f"overlapping pieces in buffer {key}"
    return buffers


def materialize_with(layout: Layout, prefix: str, names) -> tuple[dict, dict, list[np.ndarray]]:
    """``materialize(layout)``, ``tensor_values(layout)`` and the values of the
    ``{prefix}.{name}_proj.weight`` tensors, in ``names`` order."""
    values = tensor_values(layout)
    return materialize(layout), values, [values[f"{prefix}.{n}_proj.weight"] for n in names]


TINY = ModelConfig(name="tiny", hidden_size=3, num_layers=2, vocab_size=10, num_heads=4, num_kv_heads=2,
                   head_dim=2, intermediate_size=4, qk_norm=True)
TINY_MOE_MLA = ModelConfig(
    name="tiny-mla", hidden_size=3, num_layers=3, vocab_size=10, num_heads=4, num_kv_heads=4, head_dim=1,
    intermediate_size=4, num_experts=4, moe_intermediate_size=2, num_shared_experts=1, first_k_dense=1,
    router_bias=True, q_lora_rank=3, kv_lora_rank=2, qk_nope_head_dim=2, qk_rope_head_dim=1, v_head_dim=2,
)

# ---- parameter counts ----------------------------------------------------------------------

# Published totals (without MTP layers). Kimi-K2: Moonshot's report says 1.04T, which
# includes one MTP layer the released checkpoint does not ship; HF counts ~1.03T.
PUBLISHED = {
    "qwen3-235b-a22b": 235e9,
    "qwen3-30b-a3b": 30.5e9,
    "deepseek-v3": 671e9,
    "kimi-k2": 1.03e12,
    "llama-3.1-8b": 8.03e9,
    "llama-3.1-405b": 405.9e9,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_published(name: str) -> None:
    count = parameter_count(MODELS[name])
    assert abs(count - PUBLISHED[name]) / PUBLISHED[name] < 0.01, (name, count)


def test_kimi_is_within_two_percent_of_report_total() -> None:
    assert abs(parameter_count(MODELS["kimi-k2"]) - 1.04e12) / 1.04e12 < 0.02


def test_registry_aliases_and_errors() -> None:
    assert MODELS["qwen3-235b"] is MODELS["qwen3-235b-a22b"]
    assert MODELS["Qwen/Qwen3-235B-A22B"] is MODELS["qwen3-235b-a22b"]
    assert MODELS["DeepSeek_V3"] is MODELS["deepseek-v3"]
    assert get_model("llama3.1-8b") is MODELS["llama-3.1-8b"]
    assert list(MODELS) == ["qwen3-235b-a22b", "qwen3-30b-a3b", "deepseek-v3", "kimi-k2", "llama-3.1-8b",
                            "llama-3.1-405b"]
    with pytest.raises(KeyError, match="unknown model 'gpt-5'"):
        MODELS["gpt-5"]
    with pytest.raises(ValueError, match="unknown model"):
        get_model("gpt-5")


def test_deepseek_inventory_details() -> None:
    c = MODELS["deepseek-v3"]
    names = {t.name: t for t in logical_tensors(c)}
    assert "model.layers.2.mlp.gate_proj.weight" in names  # 3 dense layers
    assert "model.layers.3.mlp.gate_proj.weight" not in names
    assert names["model.layers.3.mlp.experts.gate_proj.weight"].shape == (256, 2048, 7168)
    assert names["model.layers.3.mlp.experts.down_proj.weight"].shape == (256, 7168, 2048)
    assert names["model.layers.60.mlp.gate.e_score_correction_bias"].dtype == "float32"
    assert names["model.layers.0.self_attn.kv_b_proj.weight"].shape == (128 * 256, 512)
    assert names["model.layers.0.self_attn.q_b_proj.weight"].shape == (128 * 192, 1536)
    assert "model.layers.61.input_layernorm.weight" not in names  # no MTP layer
    cut = {t.name for t in logical_tensors(c, num_layers=4)}
    assert {"model.layers.2.mlp.down_proj.weight", "model.layers.3.mlp.experts.up_proj.weight",
            "lm_head.weight", "model.embed_tokens.weight"} <= cut
    assert "model.layers.4.input_layernorm.weight" not in cut


def test_model_config_validation() -> None:
    with pytest.raises(ValueError, match="num_heads 6 is not a multiple of num_kv_heads 4"):
        ModelConfig(name="x", hidden_size=8, num_layers=1, vocab_size=8, num_heads=6, num_kv_heads=4,
                    head_dim=2, intermediate_size=8)
    with pytest.raises(ValueError, match="hidden_size must be >= 1, got 0"):
        ModelConfig(name="x", hidden_size=0, num_layers=1, vocab_size=8, num_heads=1, num_kv_heads=1,
                    head_dim=2, intermediate_size=8)
    with pytest.raises(ValueError, match=r"num_layers must be in 1\.\.2, got 3"):
        TINY.with_layers(3)


# ---- config.json ---------------------------------------------------------------------------


def test_config_from_hf_reads_local_file(tmp_path) -> None:
    raw = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 3, "vocab_size": 1000,
           "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
           "moe_intermediate_size": 32, "num_experts": 8, "tie_word_embeddings": True,
           "torch_dtype": "float16"}
    folder = tmp_path / "my-qwen"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    c = config_from_hf(folder)
    assert (c.name, c.hidden_size, c.num_layers, c.num_kv_heads, c.head_dim, c.num_experts) == (
        "my-qwen", 64, 3, 2, 16, 8)
    assert c.qk_norm and c.tie_word_embeddings and c.dtype == "float16" and c.is_moe
    assert config_from_hf(folder / "config.json") == c
    names = {t.name for t in logical_tensors(c)}
    assert "lm_head.weight" not in names and "model.layers.2.self_attn.k_norm.weight" in names


def test_config_from_hf_deepseek_file_matches_registry(tmp_path) -> None:
    from importlib import resources

    text = (resources.files("elastic_refit.layout") / "configs" / "deepseek-v3.json").read_text()
    (tmp_path / "config.json").write_text(text)
    c = config_from_hf(tmp_path / "config.json", name="deepseek-v3")
    assert c == MODELS["deepseek-v3"]
    assert (c.first_k_dense, c.num_shared_experts, c.router_bias, c.q_lora_rank) == (3, 1, True, 1536)


def test_config_from_hf_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="model_type 'mamba' is not supported"):
        config_from_hf({"model_type": "mamba"})
    with pytest.raises(ValueError, match="missing 'hidden_size'"):
        config_from_hf({"model_type": "llama"})
    with pytest.raises(ValueError, match="no HF config"):
        config_from_hf(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        config_from_hf(tmp_path / "bad.json")


# ---- parallelism ---------------------------------------------------------------------------


def test_parse_parallelism() -> None:
    assert parse_parallelism("tp=4,pp=8,ep=16,dp=4") == TrainingParallelism(4, 8, 4, 16)
    assert parse_parallelism("TP=8, dp=16") == InferenceParallelism(8, 16, 1)
    assert parse_parallelism("tp=8,dp=16", side="training") == TrainingParallelism(8, 1, 16)
    assert parse_parallelism("pp=16,ep=16,dp=16").world_size == 256
    assert str(TrainingParallelism(4, 8, 4, 16)) == "tp=4,pp=8,dp=4,ep=16"


@pytest.mark.parametrize(("text", "message"), [
    ("tp=4,cp=2", "unknown parallelism key 'cp'"),
    ("tp=0", "tp=0 .* must be >= 1"),
    ("tp=-2", "tp=-2 .* must be >= 1"),
    ("tp=four", "'four' .* is not an integer"),
    ("tp=4,tp=2", "given twice"),
    ("tp4", "use key=value"),
    ("tp=4,pp=2,dp=3,ep=8", "ep=8 must divide tp\\*dp=12"),
    ("tp=2,dp=2,ep=3", "ep=3 must divide tp\\*dp=4"),
    ("tp=2,etp=2", "only etp=1"),
    ("", "parallelism must be a string"),
])
def test_parse_parallelism_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_parallelism(text)


def test_parallelism_dataclass_errors() -> None:
    with pytest.raises(ValueError, match="pp must be a positive integer, got 0"):
        TrainingParallelism(tp=1, pp=0, dp=1)
    with pytest.raises(ValueError, match="inference layouts have no pipeline stages"):
        parse_parallelism("tp=2,pp=2", side="inference")
    with pytest.raises(ValueError, match="vLLM layouts have no pipeline stages"):
        vllm_layout(TINY, TrainingParallelism(1, 2, 1))


def test_layouts_refuse_unsupported_splits() -> None:
    qwen = MODELS["qwen3-235b"]
    with pytest.raises(ValueError, match=r"Megatron-core splits the 4 kv heads .* tp=8"):
        megatron_layout(qwen, "tp=8,pp=1", num_layers=1)
    with pytest.raises(ValueError, match="ep=3 to divide the 128 experts"):
        megatron_layout(qwen, "tp=1,pp=1,dp=3,ep=3", num_layers=1)
    with pytest.raises(ValueError, match="64 attention heads do not split over tp=3"):
        vllm_layout(qwen, "tp=3", num_layers=1)
    with pytest.raises(ValueError, match="tp=6 must be a multiple of the 4 kv heads"):
        vllm_layout(ModelConfig(name="x", hidden_size=8, num_layers=1, vocab_size=64, num_heads=12,
                                num_kv_heads=4, head_dim=2, intermediate_size=6), "tp=6")
    with pytest.raises(ValueError, match="first_rank must be an integer >= 0, got -1"):
        vllm_layout(TINY, "tp=1", first_rank=-1)


# ---- tiny models, element-wise -------------------------------------------------------------


def test_megatron_qkv_interleave_tp2() -> None:
    layout = megatron_layout(TINY, TrainingParallelism(tp=2, pp=1, dp=1))
    bufs, _, (q, k, vv) = materialize_with(layout, "model.layers.1.self_attn", "qkv")
    # 4 q heads in 2 groups of 2, head_dim 2: tp rank t holds group t = [q heads 2t, 2t+1; k_t; v_t].
    for t in range(2):
        expected = np.concatenate([q[4 * t:4 * t + 4], k[2 * t:2 * t + 2], vv[2 * t:2 * t + 2]])
        np.testing.assert_array_equal(bufs[t, "decoder.layers.1.self_attention.linear_qkv.weight"], expected)


def test_megatron_qkv_interleave_tp1_two_groups() -> None:
    bufs, _, (q, k, vv) = materialize_with(megatron_layout(TINY, "tp=1,pp=1"), "model.layers.0.self_attn", "qkv")
    buf = bufs[0, "decoder.layers.0.self_attention.linear_qkv.weight"]
    expected = np.concatenate([q[0:4], k[0:2], vv[0:2], q[4:8], k[2:4], vv[2:4]])
    np.testing.assert_array_equal(buf, expected)


def test_vllm_qkv_replicates_kv_heads_when_tp_exceeds_them() -> None:
    bufs, _, (q, k, vv) = materialize_with(vllm_layout(TINY, "tp=4"), "model.layers.0.self_attn", "qkv")
    for t in range(4):
        g = t // 2  # 2 kv heads over 4 ranks: each replicated twice
        expected = np.concatenate([q[2 * t:2 * t + 2], k[2 * g:2 * g + 2], vv[2 * g:2 * g + 2]])
        np.testing.assert_array_equal(bufs[t, "model.layers.0.self_attn.qkv_proj.weight"], expected)


def test_fused_gate_up_and_row_parallel_down() -> None:
    v = tensor_values(megatron_layout(TINY, "tp=2,pp=1"))
    gate, up, down = (v[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up", "down"))
    for build, fc1, fc2 in ((lambda: megatron_layout(TINY, "tp=2,pp=1"), "decoder.layers.0.mlp.linear_fc1.weight",
                             "decoder.layers.0.mlp.linear_fc2.weight"),
                            (lambda: vllm_layout(TINY, "tp=2"), "model.layers.0.mlp.gate_up_proj.weight",
                             "model.layers.0.mlp.down_proj.weight")):
        bufs = materialize(build())
        for t in range(2):
            np.testing.assert_array_equal(bufs[t, fc1], np.concatenate([gate[2 * t:2 * t + 2], up[2 * t:2 * t + 2]]))
            np.testing.assert_array_equal(bufs[t, fc2], down[:, 2 * t:2 * t + 2])


def test_vocab_padding_rows_are_uncovered() -> None:
    # Megatron: vocab 10 padded to 128 * tp = 256, 128 rows per rank; rank 1 holds padding only.
    bufs = materialize(megatron_layout(TINY, "tp=2,pp=1"))
    emb = bufs[0, "embedding.word_embeddings.weight"]
    assert emb.shape == (128, 3)
    assert not np.isnan(emb[:10]).any() and np.isnan(emb[10:]).all()
    assert np.isnan(bufs[1, "output_layer.weight"]).all()
    # vLLM: padded to 64, 16 rows per rank over tp=4.
    bufs = materialize(vllm_layout(TINY, "tp=4"))
    head = bufs[0, "lm_head.weight"]
    assert head.shape == (16, 3)
    assert not np.isnan(head[:10]).any() and np.isnan(head[10:]).all()
    assert np.isnan(bufs[3, "model.embed_tokens.weight"]).all()


def test_megatron_experts_and_mla() -> None:
    layout = megatron_layout(TINY_MOE_MLA, "tp=2,pp=1,dp=2,ep=2")
    bufs, v, (gate, up, down) = materialize_with(layout, "model.layers.1.mlp.experts", ("gate", "up", "down"))
    for rank in range(4):
        e = rank % 2  # ep is the fastest factor of the stage's tp x dp ranks
        fc1 = bufs[rank, "decoder.layers.1.mlp.experts.linear_fc1.weight"]
        np.testing.assert_array_equal(fc1, np.concatenate([gate[2 * e:2 * e + 2], up[2 * e:2 * e + 2]], axis=1))
        np.testing.assert_array_equal(bufs[rank, "decoder.layers.1.mlp.experts.linear_fc2.weight"],
                                      down[2 * e:2 * e + 2])
        t = rank % 2
        qb = v["model.layers.2.self_attn.q_b_proj.weight"]  # 4 heads x 3 rows
        np.testing.assert_array_equal(bufs[rank, "decoder.layers.2.self_attention.linear_q_up_proj.weight"],
                                      qb[6 * t:6 * t + 6])
        np.testing.assert_array_equal(bufs[rank, "decoder.layers.0.self_attention.linear_kv_down_proj.weight"],
                                      v["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"])
    assert layout.tensor("model.layers.1.mlp.gate.e_score_correction_bias").dtype == "float32"
    assert not uncovered_tensors(layout)


def test_vllm_experts_and_mla() -> None:
    layout = vllm_layout(TINY_MOE_MLA, "tp=2,dp=1")
    bufs, v, (gate, up, down) = materialize_with(layout, "model.layers.2.mlp.experts", ("gate", "up", "down"))
    for t in range(2):
        np.testing.assert_array_equal(bufs[t, "model.layers.2.mlp.experts.w13_weight"],
                                      np.concatenate([gate[:, t:t + 1], up[:, t:t + 1]], axis=1))
        np.testing.assert_array_equal(bufs[t, "model.layers.2.mlp.experts.w2_weight"], down[:, :, t:t + 1])
        np.testing.assert_array_equal(
            bufs[t, "model.layers.0.self_attn.fused_qkv_a_proj.weight"],
            np.concatenate([v["model.layers.0.self_attn.q_a_proj.weight"],
                            v["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]]))
        kvb = v["model.layers.0.self_attn.kv_b_proj.weight"]  # 4 heads x (2 nope + 2 v)
        np.testing.assert_array_equal(bufs[t, "model.layers.0.self_attn.kv_b_proj.weight"], kvb[8 * t:8 * t + 8])
    # Expert parallel over tp*dp = 3 ranks with 4 experts: counts 2, 1, 1 (vLLM's linear map).
    ep_layout = vllm_layout(TINY_MOE_MLA, "tp=1,dp=3,ep=3")
    bufs = materialize(ep_layout)
    shapes = [bufs[r, "model.layers.1.mlp.experts.w13_weight"].shape for r in range(3)]
    assert shapes == [(2, 4, 3), (1, 4, 3), (1, 4, 3)]
    np.testing.assert_array_equal(bufs[2, "model.layers.1.mlp.experts.w2_weight"],
                                  tensor_values(ep_layout)["model.layers.1.mlp.experts.down_proj.weight"][3:4])
    assert not uncovered_tensors(ep_layout)


def test_uneven_pipeline_stages_use_local_layer_names() -> None:
    assert [list(r) for r in stage_layers(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [len(r) for r in stage_layers(2, 3)] == [1, 1, 0]
    cfg = ModelConfig(name="five", hidden_size=3, num_layers=5, vocab_size=10, num_heads=2, num_kv_heads=2,
                      head_dim=1, intermediate_size=2)
    layout = megatron_layout(cfg, "tp=1,pp=2,dp=1", first_rank=7)
    by_rank = {r: {b.name for b in layout.buffers(r)} for r in layout.ranks}
    assert set(by_rank) == {7, 8}
    assert "embedding.word_embeddings.weight" in by_rank[7] and "output_layer.weight" in by_rank[8]
    assert "decoder.layers.2.mlp.linear_fc1.weight" in by_rank[7]
    assert "decoder.layers.2.mlp.linear_fc1.weight" not in by_rank[8]
    piece = next(p for p in layout.pieces("model.layers.3.mlp.up_proj.weight"))
    assert (piece.rank, piece.buffer) == (8, "decoder.layers.0.mlp.linear_fc1.weight")
    assert not uncovered_tensors(layout)


def test_tied_embeddings() -> None:
    cfg = ModelConfig(name="tied", hidden_size=3, num_layers=2, vocab_size=10, num_heads=2, num_kv_heads=2,
                      head_dim=1, intermediate_size=2, tie_word_embeddings=True)
    assert "lm_head.weight" not in {t.name for t in logical_tensors(cfg)}
    layout = megatron_layout(cfg, "tp=1,pp=2")
    holders = {(p.rank, p.buffer) for p in layout.pieces("model.embed_tokens.weight")}
    assert holders == {(0, "embedding.word_embeddings.weight"), (1, "output_layer.weight")}
    assert {p.buffer for p in vllm_layout(cfg, "tp=1").pieces("model.embed_tokens.weight")} == {
        "model.embed_tokens.weight"}


def test_num_layers_cut_keeps_first_k_dense_rule() -> None:
    layout = vllm_layout("deepseek-v3", "tp=8", num_layers=4)
    names = {t.name for t in layout.tensors}
    assert "model.layers.2.mlp.down_proj.weight" in names
    assert "model.layers.3.mlp.experts.down_proj.weight" in names
    assert "model.layers.4.input_layernorm.weight" not in names
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= names
    assert {t.name for t in layout.tensors} == {t.name for t in logical_tensors(MODELS["deepseek-v3"], 4)}


# ---- full scale ----------------------------------------------------------------------------

FULL_SCALE = [
    ("qwen3-235b-a22b", megatron_layout, "tp=4,pp=8,ep=16,dp=4", 0, 128),
    ("qwen3-235b-a22b", vllm_layout, "tp=8,dp=16", 128, 128),
    ("deepseek-v3", megatron_layout, "pp=16,ep=16,dp=16", 0, 256),
    ("deepseek-v3", vllm_layout, "tp=32,dp=8", 256, 256),
]


@pytest.mark.parametrize(("model", "build", "par", "first_rank", "num_ranks"), FULL_SCALE)
def test_full_scale_layouts_hold_every_element(model, build, par, first_rank, num_ranks) -> None:
    start = time.perf_counter()
    layout = build(model, par, first_rank=first_rank)
    seconds = time.perf_counter() - start
    print(f"\n{model} {build.__name__} {par}: {layout.num_pieces} pieces, {layout.num_buffers} buffers, "
          f"built in {seconds:.3f} s")
    assert layout.ranks == tuple(range(first_rank, first_rank + num_ranks))
    assert {t.name for t in layout.tensors} == {t.name for t in logical_tensors(MODELS[model])}
    # bf16 weights, fp32 router biases
    assert layout.model_nbytes == 2 * parameter_count(MODELS[model]) + 2 * sum(
        t.numel for t in logical_tensors(MODELS[model]) if t.dtype == "float32")
    assert uncovered_tensors(layout) == []
    assert overlapping_buffers(layout) == []


MORE_SCALES = [
    ("kimi-k2", megatron_layout, "tp=8,pp=16,ep=64,dp=8", {}),
    ("kimi-k2", vllm_layout, "tp=8,dp=8,ep=64", {}),
    ("llama-3.1-405b", megatron_layout, "tp=8,pp=16,dp=2", {}),
    ("llama-3.1-405b", vllm_layout, "tp=16,dp=2", {}),  # 8 kv heads, each on 2 ranks
    ("llama-3.1-8b", vllm_layout, "tp=4,dp=4", {}),
    ("qwen3-30b-a3b", vllm_layout, "tp=4,dp=2", {"flatten_moe_tp": True}),
    ("qwen3-30b-a3b", megatron_layout, "tp=2,pp=3,ep=8,dp=4", {}),
]


@pytest.mark.parametrize(("model", "build", "par", "options"), MORE_SCALES)
def test_other_models_hold_every_element(model, build, par, options) -> None:
    layout = build(model, par, **options)
    assert {t.name for t in layout.tensors} == {t.name for t in logical_tensors(MODELS[model])}
    assert uncovered_tensors(layout) == []
    assert overlapping_buffers(layout) == []


def test_flattened_moe_tp_shards_experts_over_all_ranks() -> None:
    layout = vllm_layout("qwen3-30b-a3b", "tp=4,dp=2", num_layers=1, flatten_moe_tp=True)
    w2 = [b for b in layout.buffers() if b.name == "model.layers.0.mlp.experts.w2_weight"]
    assert {b.shape for b in w2} == {(128, 2048, 768 // 8)}
    plain = vllm_layout("qwen3-30b-a3b", "tp=4,dp=2", num_layers=1)
    assert {b.shape for b in plain.buffers() if b.name == "model.layers.0.mlp.experts.w2_weight"} == {
        (128, 2048, 768 // 4)}


def test_overlap_check_detects_an_overlap() -> None:
    from elastic_refit.layout import LayoutBuilder

    b = LayoutBuilder()
    t = b.tensor("w", (4,), "float32")
    ids = b.buffers("buf", [0], (4,), "float32")
    b.pieces(t, [ids[0], ids[0]], [[0], [2]], [[3], [2]], [[0], [1]])
    assert overlapping_buffers(b.build()) == ["rank 0 buf"]


def test_coverage_check_detects_a_hole() -> None:
    layout = vllm_layout(TINY, "tp=2")
    holed = layout.without_ranks([1])  # rank 1's TP shards are gone
    missing = uncovered_tensors(holed)
    assert "model.layers.0.self_attn.q_proj.weight" in missing
    assert "model.norm.weight" not in missing


@st.composite
def tiny_setups(draw):
    mla = draw(st.booleans())
    moe = draw(st.booleans())
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2, 3]))
    layers = draw(st.integers(1, 4))
    config = ModelConfig(
        name="random", hidden_size=draw(st.integers(2, 4)), num_layers=layers,
        vocab_size=draw(st.integers(3, 300)), num_heads=heads, num_kv_heads=heads if mla else kv,
        head_dim=draw(st.sampled_from([1, 2])), intermediate_size=draw(st.sampled_from([4, 8, 12])),
        num_experts=draw(st.sampled_from([2, 4, 6])) if moe else 0,
        moe_intermediate_size=draw(st.sampled_from([4, 8])) if moe else 0,
        num_shared_experts=draw(st.integers(0, 2)) if moe else 0,
        first_k_dense=draw(st.integers(0, layers)) if moe else 0,
        router_bias=moe and draw(st.booleans()),
        q_lora_rank=draw(st.sampled_from([None, 3])) if mla else None,
        kv_lora_rank=2 if mla else 0, qk_nope_head_dim=2 if mla else 0,
        qk_rope_head_dim=draw(st.integers(0, 1)) if mla else 0, v_head_dim=2 if mla else 0,
        qk_norm=not mla and draw(st.booleans()),
        tie_word_embeddings=draw(st.booleans()),
    )
    tp, dp = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 3]))
    ep = draw(st.sampled_from([d for d in range(1, tp * dp + 1) if (tp * dp) % d == 0]))
    return config, tp, dp, ep, draw(st.integers(1, 3)), draw(st.booleans())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(tiny_setups())
def test_random_tiny_layouts_cover_everything_without_overlap(setup) -> None:
    config, tp, dp, ep, pp, flatten = setup
    built = []
    for build in (lambda: megatron_layout(config, TrainingParallelism(tp, pp, dp, ep)),
                  lambda: vllm_layout(config, InferenceParallelism(tp, dp, ep), first_rank=5,
                                      flatten_moe_tp=flatten)):
        try:
            built.append(build())
        except ValueError as e:  # a split the framework refuses; the message says which
            assert "split" in str(e) or "divide" in str(e) or "multiple" in str(e) or "exceeds" in str(e), e
    assume(built)
    names = {t.name for t in logical_tensors(config)}
    for layout in built:
        assert {t.name for t in layout.tensors} == names
        assert uncovered_tensors(layout) == []
        assert overlapping_buffers(layout) == []
        materialize(layout)
