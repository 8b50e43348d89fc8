"""Destination formats: parsing, per-tensor declarations (spec files, side files, presets,
self-described models), and layouts that stay the same with or without a format."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from elastic_refit.layout import (
    BF16,
    FP8_BLOCK128,
    MXFP8,
    DestinationFormat,
    TensorFormats,
    checkpoint_formats,
    formats_from_tensors,
    from_dtensors,
    get_model,
    is_checkpoint_quantized,
    load_side_formats,
    logical_tensors,
    parse_format,
    parse_side,
    parse_side_formats,
    parse_spec,
)
from elastic_refit.layout.refit import model_refit_spec
from elastic_refit.layout.spec import RefitSpec

SPEC = {
    "domain_size": 2,
    "tensors": [
        {"name": "w", "shape": [300, 256], "dtype": "bfloat16",
         "source": {"mesh": [0, 1], "placements": ["S(0)"]},
         "destination": {"mesh": [2, 3], "placements": ["S(1)"], "format": "fp8-block128"}},
        {"name": "e", "shape": [4, 64, 96], "dtype": "bfloat16",
         "source": {"mesh": [0, 1], "placements": ["S(0)"]},
         "destination": {"mesh": [2, 3], "placements": ["S(0)"], "format": "mxfp8"}},
        {"name": "norm", "shape": [256], "dtype": "bfloat16",
         "source": {"mesh": [0, 1], "placements": ["R"]},
         "destination": {"mesh": [2, 3], "placements": ["R"]}},
    ],
}


def without_formats(spec: dict) -> dict:
    out = copy.deepcopy(spec)
    for t in out["tensors"]:
        t["destination"].pop("format", None)
    return out


# -- formats -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "want"),
    [("bf16", "bf16"), ("bfloat16", "bf16"), ("none", "bf16"), ("fp8-block128", "fp8-block128"),
     ("FP8", "fp8-block128"), ("fp8_e4m3", "fp8-block128"), (" mxfp8 ", "mxfp8"), ("fp8-block64", "fp8-block64")],
)
def test_parse_format_and_aliases(text, want):
    assert parse_format(text).name == want
    assert parse_format(parse_format(text)) == parse_format(text)


@pytest.mark.parametrize("text", ["fp4", "fp8-block100", "fp8-block1024", "fp8-block0128", "", None, 3])
def test_unknown_formats_are_value_errors(text):
    with pytest.raises(ValueError, match="format"):
        parse_format(text)


def test_format_properties():
    assert not BF16.quantized and BF16.scale_shape((4, 4)) == () and BF16.nbytes((4, 4)) == 32
    assert FP8_BLOCK128.block_shape == (128, 128) and FP8_BLOCK128.scale_dtype == "float32"
    assert FP8_BLOCK128.scale_shape((576, 7168)) == (5, 56)  # DeepSeek-V3 kv_a_proj_with_mqa
    assert FP8_BLOCK128.scale_shape((256, 2048, 7168)) == (256, 16, 56)  # stacked experts
    assert FP8_BLOCK128.scale_name("x.weight") == "x.weight_scale_inv"
    assert FP8_BLOCK128.nbytes((576, 7168)) == 576 * 7168 + 5 * 56 * 4
    assert MXFP8.block_shape == (1, 32) and MXFP8.scale_dtype == "uint8"
    assert MXFP8.scale_shape((64, 100)) == (64, 4) and MXFP8.scale_name("x.weight") == "x.weight_scale"
    assert FP8_BLOCK128.block_box((0, 128), (200, 300)) == ((0, 1), (2, 3))
    assert FP8_BLOCK128.is_block_aligned((128, 0), (172, 256), (300, 256))  # partial edge block
    assert not FP8_BLOCK128.is_block_aligned((64, 0), (64, 256), (300, 256))
    with pytest.raises(ValueError, match="last two dims"):
        FP8_BLOCK128.check_tensor("norm", (256,))
    with pytest.raises(ValueError, match="int8"):
        MXFP8.check_tensor("w", (4, 4), "int8")


def test_tensor_formats_are_canonical():
    a = TensorFormats.from_mapping({"b": "fp8", "a": "mxfp8", "c": "bf16"})
    b = TensorFormats((("a", MXFP8), ("b", FP8_BLOCK128)))
    assert a == b and a.fingerprint == b.fingerprint and len(a) == 2 and list(a) == ["a", "b"]
    assert a.of("c") == BF16 and a.of("zzz") == BF16 and "a" in a and "c" not in a
    assert TensorFormats().fingerprint == "" == TensorFormats.from_mapping({"x": "bf16"}).fingerprint
    assert TensorFormats.from_json(a.to_json()) == a
    assert a.fingerprint != TensorFormats.from_mapping({"a": "mxfp8"}).fingerprint
    with pytest.raises(ValueError, match="declared with formats"):
        TensorFormats((("a", "fp8"), ("a", "mxfp8")))
    with pytest.raises(ValueError, match="malformed"):
        TensorFormats.from_json("{")


# -- spec and side files ---------------------------------------------------------------------
def test_spec_file_formats_leave_the_layouts_unchanged():
    spec = parse_spec(SPEC)
    plain = parse_spec(without_formats(SPEC))
    assert spec.destination_formats.as_dict() == {"w": FP8_BLOCK128, "e": MXFP8}
    assert plain.destination_formats == TensorFormats() and plain.destination_formats.fingerprint == ""
    assert spec.source.fingerprint == plain.source.fingerprint
    assert spec.destination.fingerprint == plain.destination.fingerprint
    assert RefitSpec(plain.source, plain.destination, plain.topology) == plain


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: s["tensors"][2]["destination"].update(format="fp8-block128"), "'norm'.*last two dims"),
        (lambda s: s["tensors"][0]["destination"].update(format="fp4"), "tensor 'w' destination: unknown destination format"),
        (lambda s: s["tensors"][0]["source"].update(format="fp8"), "tensor 'w' source: 'format' describes"),
    ],
)
def test_spec_file_format_errors_name_the_tensor(edit, match):
    bad = copy.deepcopy(SPEC)
    edit(bad)
    with pytest.raises(ValueError, match=match):
        parse_spec(bad)


def test_side_file_formats(tmp_path):
    side = {"tensors": [
        {"name": "w", "shape": [300, 256], "mesh": [0, 1], "placements": ["S(1)"], "format": "fp8"},
        {"name": "n", "shape": [256], "mesh": [0, 1], "placements": ["R"]},
    ]}
    assert parse_side_formats(side).as_dict() == {"w": FP8_BLOCK128}
    path = tmp_path / "side.json"
    path.write_text(json.dumps(side))
    assert load_side_formats(path).as_dict() == {"w": FP8_BLOCK128}
    side["tensors"][0].pop("format")
    assert parse_side(side).fingerprint == parse_side({**side}).fingerprint
    assert parse_side_formats(side) == TensorFormats()


# -- presets -----------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["deepseek-v3", "kimi-k2"])
def test_presets_quantize_what_the_fp8_checkpoints_quantize(model):
    formats = checkpoint_formats(model, num_layers=5)
    names = {t.name for t in logical_tensors(get_model(model), 5)}
    assert set(formats) <= names and all(formats.of(n) == FP8_BLOCK128 for n in formats)
    for n in ("self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
              "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight"):
        assert f"model.layers.0.{n}" in formats
    for n in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):  # dense layers
        assert f"model.layers.0.{n}" in formats
    for n in ("experts.gate_proj.weight", "experts.up_proj.weight", "experts.down_proj.weight",
              "shared_experts.gate_proj.weight", "shared_experts.down_proj.weight"):
        assert f"model.layers.4.mlp.{n}" in formats
    kept = names - set(formats)
    assert kept == {n for n in names if "norm" in n or n.endswith(("mlp.gate.weight", "e_score_correction_bias"))
                    or n in ("model.embed_tokens.weight", "lm_head.weight")}
    assert not is_checkpoint_quantized("model.layers.4.mlp.gate.weight")
    assert checkpoint_formats(model, "bf16") == TensorFormats()
    assert set(checkpoint_formats(model, "mxfp8", num_layers=5)) == set(formats)


def test_model_refit_spec_with_a_destination_format_keeps_the_layouts():
    bf16 = model_refit_spec("deepseek-v3", "pp=2,ep=4,dp=4", "tp=4,dp=2", num_layers=4)
    fp8 = model_refit_spec("deepseek-v3", "pp=2,ep=4,dp=4", "tp=4,dp=2", num_layers=4,
                           destination_format="fp8-block128")
    assert bf16.source.fingerprint == fp8.source.fingerprint
    assert bf16.destination.fingerprint == fp8.destination.fingerprint
    assert bf16.destination_formats.fingerprint == "" != fp8.destination_formats.fingerprint
    assert fp8.destination_formats == checkpoint_formats("deepseek-v3", num_layers=4)


# -- self-described -----------------------------------------------------------------------------
def test_a_quantized_model_describes_its_formats():
    named = {
        "a.weight": torch.zeros(300, 256, dtype=torch.float8_e4m3fn),
        "a.weight_scale_inv": torch.zeros(3, 2),
        "b.weight": torch.zeros(64, 96, dtype=torch.float8_e4m3fn),
        "b.weight_scale": torch.zeros(64, 3, dtype=torch.uint8),
        "n.weight": torch.zeros(256, dtype=torch.bfloat16),
    }
    formats = formats_from_tensors(named)
    assert formats.as_dict() == {"a.weight": FP8_BLOCK128, "b.weight": MXFP8}
    layout = from_dtensors(named, formats=formats, plain_ranks=[0, 1]).build()
    assert [(t.name, t.dtype) for t in layout.tensors] == [
        ("a.weight", "bfloat16"), ("b.weight", "bfloat16"), ("n.weight", "bfloat16")]
    # The same layout a BF16 model of those shapes describes: plans see logical tensors.
    bf16 = {"a.weight": torch.zeros(300, 256, dtype=torch.bfloat16), "b.weight": torch.zeros(64, 96, dtype=torch.bfloat16),
            "n.weight": torch.zeros(256, dtype=torch.bfloat16)}
    assert from_dtensors(bf16, plain_ranks=[0, 1]).build().fingerprint == layout.fingerprint
    assert formats_from_tensors({"a.weight": torch.zeros(64, 64, dtype=torch.float8_e4m3fn),
                                 "a.weight_scale_inv": torch.zeros(4, 4)}).of("a.weight") == DestinationFormat("fp8-block16")
    with pytest.raises(ValueError, match=r"'lonely\.weight' is float8_e4m3fn"):
        formats_from_tensors({"lonely.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn)})
