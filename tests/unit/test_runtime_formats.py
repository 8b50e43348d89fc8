"""Destination formats in the runtime's pure parts: self-described layouts that carry them
(encoding format 2, fingerprints), ``plan_attempt`` in the destination format (trainers
quantize, FP8 holders serve as they hold), members that disagree, and ``next_action``
turning FP8 holders of a refit into destinations."""

from __future__ import annotations

import json

import pytest

from elastic_refit.layout import (
    TensorFormats,
    decode_described,
    decode_layout,
    described_fingerprint,
    encode_layout,
    parse_spec,
)
from elastic_refit.plan import destination_format_layout
from elastic_refit.runtime.attempt import (
    CATCH_UP,
    REFIT,
    AttemptSpec,
    attempt_formats,
    format_disagreement,
    next_action,
    plan_attempt,
)

from .test_runtime_decisions import state, view

SPEC = parse_spec({
    "domains": [0, 0, 1, 1, 2, 2],
    "tensors": [
        {"name": "q.weight", "shape": [320, 288], "dtype": "bfloat16",
         "source": {"mesh": [0, 1], "placements": ["S(0)"]},
         "destination": {"mesh": [[2, 3], [4, 5]], "placements": ["R", "S(1)"], "format": "fp8-block128"}},
        {"name": "up.weight", "shape": [2, 96, 80], "dtype": "bfloat16",
         "source": {"mesh": [0, 1], "placements": ["S(1)"]},
         "destination": {"mesh": [[2, 3], [4, 5]], "placements": ["R", "S(0)"], "format": "mxfp8"}},
        {"name": "norm.weight", "shape": [288], "dtype": "bfloat16",
         "source": {"mesh": [0, 1], "placements": ["R"]},
         "destination": {"mesh": [[2, 3], [4, 5]], "placements": ["R", "R"]}},
    ],
})
FORMATS = SPEC.destination_formats
FP8_ONLY = TensorFormats.from_mapping({"q.weight": "fp8-block128"})
TRAIN, INFER = "train", "infer"


# ---- the self-description ----------------------------------------------------------------
def test_formats_travel_with_the_layout_under_a_fingerprint_that_covers_both():
    blob = encode_layout(SPEC.destination, FORMATS)
    assert blob[:4] == b"ERL2"
    fingerprint = described_fingerprint(SPEC.destination, FORMATS)
    layout, formats = decode_described(blob, fingerprint)
    assert layout.fingerprint == SPEC.destination.fingerprint and formats == FORMATS
    assert decode_layout(blob, fingerprint).fingerprint == SPEC.destination.fingerprint
    # another set of formats on the same pieces is another description
    assert len({fingerprint, described_fingerprint(SPEC.destination, FP8_ONLY), SPEC.destination.fingerprint}) == 3
    with pytest.raises(ValueError, match="encoded layout has fingerprint"):
        decode_described(blob, described_fingerprint(SPEC.destination, FP8_ONLY))


def test_a_side_without_quantized_formats_encodes_and_fingerprints_as_before():
    for formats in (None, TensorFormats(), TensorFormats.from_mapping({"norm.weight": "bf16"})):
        blob = encode_layout(SPEC.source, formats)
        assert blob[:4] == b"ERL1" and blob == encode_layout(SPEC.source)
        assert described_fingerprint(SPEC.source, formats) == SPEC.source.fingerprint
        layout, decoded = decode_described(blob, SPEC.source.fingerprint)
        assert layout.fingerprint == SPEC.source.fingerprint and not decoded


def test_formats_of_tensors_the_layout_lacks_are_refused_on_both_ends():
    bad = TensorFormats.from_mapping({"nope.weight": "fp8"})
    with pytest.raises(ValueError, match=r"declared for tensor 'nope\.weight', which the layout lacks"):
        encode_layout(SPEC.destination, bad)


# ---- plan_attempt ------------------------------------------------------------------------
MEMBERS = ("t0", "t1", "i0", "i1", "i2")


def _of(formats_by_member: dict[str, TensorFormats]):
    def layout_of(record, fingerprint):
        return SPEC.source if record.role == "trainer" else SPEC.destination

    def formats_of(record, fingerprint):
        return formats_by_member.get(record.member_id, TensorFormats())

    return layout_of, formats_of


def _spec(kind, sources, holders, destinations) -> AttemptSpec:
    return AttemptSpec(1, kind, sources, holders, destinations,
                       tuple((m, TRAIN if m.startswith("t") else INFER) for m in (*sources, *holders, *destinations)))


ALL_FP8 = {"i0": FORMATS, "i1": FORMATS, "i2": FORMATS}


def test_a_refit_into_fp8_quantizes_on_the_trainers():
    v = view(*MEMBERS)
    layout_of, formats_of = _of(ALL_FP8)
    plan = plan_attempt(layout_of, v, _spec(REFIT, ("t0", "t1"), (), ("i0", "i1")), formats_of=formats_of)
    assert plan.quantization is not None and plan.quantization.formats == FORMATS
    held = destination_format_layout(SPEC.destination, FORMATS)
    want = {(b.name, b.shape, b.dtype) for r in (2, 3) for b in held.buffers(r)}
    got = {(b.name, b.shape, b.dtype) for r in (v.rank_of("i0"), v.rank_of("i1")) for b in plan.destination.buffers(r)}
    assert got == want
    assert {"q.weight_scale_inv", "up.weight_scale"} <= {b[0] for b in got}
    # the trainers' BF16 shards cut 128-blocks (160 of 320 rows): exchanged partial amax
    assert len(plan.quantization.amax) > 0


def test_a_catch_up_from_fp8_holders_moves_their_fp8_bytes_and_scales_as_they_are():
    v = view(*MEMBERS)
    layout_of, formats_of = _of(ALL_FP8)
    plan = plan_attempt(layout_of, v, _spec(CATCH_UP, (), ("i0", "i1"), ("i2",)), formats_of=formats_of)
    assert plan.quantization is None  # nothing to quantize: the holders hold the format
    held = destination_format_layout(SPEC.destination, FORMATS)
    i2 = v.rank_of("i2")
    assert {(b.name, b.shape, b.dtype) for b in plan.destination.buffers(i2)} == \
        {(b.name, b.shape, b.dtype) for b in held.buffers(4)}
    for holder, rank in (("i0", 2), ("i1", 3)):  # a holder serves from the buffers it received into
        assert {(b.name, b.shape, b.dtype) for b in plan.source.buffers(v.rank_of(holder))} == \
            {(b.name, b.shape, b.dtype) for b in held.buffers(rank)}
    assert plan.source.tensor("q.weight").dtype == "float8_e4m3fn"
    assert plan.source.tensor("q.weight_scale_inv").shape == (3, 3)


def test_inference_members_with_different_formats_cannot_be_planned_together():
    v = view(*MEMBERS)
    layout_of, formats_of = _of({"i0": FORMATS, "i1": FP8_ONLY, "i2": FORMATS})
    spec = _spec(REFIT, ("t0", "t1"), (), ("i0", "i1"))
    why = format_disagreement(formats_of, v, spec)
    assert why is not None and why.startswith("inference members 'i0' and 'i1' declare different destination formats")
    assert "fp8-block128 on 1 tensor(s), mxfp8 on 1 tensor(s)" in why and f"formats {FORMATS.fingerprint}" in why
    with pytest.raises(ValueError, match="'i0' and 'i1' declare different"):
        plan_attempt(layout_of, v, spec, formats_of=formats_of)
    # a BF16 newcomer cannot catch up from FP8 holders either
    layout_of, formats_of = _of({"i0": FORMATS, "i1": FORMATS})
    with pytest.raises(ValueError, match=r"'i0' and 'i2' declare different.*i2: bf16 throughout"):
        plan_attempt(layout_of, v, _spec(CATCH_UP, (), ("i0", "i1"), ("i2",)), formats_of=formats_of)
    assert attempt_formats(formats_of, v, _spec(REFIT, ("t0", "t1"), (), ("i0", "i1"))) == FORMATS
    assert attempt_formats(None, v, spec) == TensorFormats()


def test_fp8_holders_cannot_send_beside_trainers():
    v = view(*MEMBERS)
    layout_of, formats_of = _of(ALL_FP8)
    with pytest.raises(ValueError, match=r"holders \['i0'\] hold version 1 in FP8 and cannot send beside"):
        plan_attempt(layout_of, v, _spec(REFIT, ("t0", "t1"), ("i0",), ("i1",)), formats_of=formats_of)


def test_next_action_makes_holders_that_cannot_serve_destinations():
    v = view(*MEMBERS)
    versions = state(sources={1: ["t0", "t1"]}, acks={1: ["i0"]})
    usual = next_action(v, versions)
    assert usual.holders == ("i0",) and usual.destinations == ("i1", "i2")
    asked = []
    fp8 = next_action(v, versions, holders_serve=lambda spec: asked.append(spec) or False)
    assert asked == [usual]
    assert fp8.kind == REFIT and fp8.sources == ("t0", "t1") and fp8.holders == ()
    assert fp8.destinations == ("i0", "i1", "i2") and fp8.layouts == usual.layouts
    assert next_action(v, versions, holders_serve=lambda spec: True) == usual
    # a catch-up has only holders to send: it is not asked
    caught = next_action(v, state(sources={1: ["t0", "t1"]}, acks={1: ["i0", "i1"]}, committed=(1,)),
                         holders_serve=lambda spec: pytest.fail("asked about a catch-up"))
    assert caught.kind == CATCH_UP and caught.holders == ("i0", "i1") and caught.destinations == ("i2",)


def test_spec_file_formats_round_trip_as_json():
    assert TensorFormats.from_json(json.dumps(json.loads(FORMATS.to_json()))) == FORMATS


# ---- the harness's check of FP8 destinations --------------------------------------------
def test_check_quantized_accepts_the_reference_bytes_and_names_every_wrong_piece():
    import torch
    from elastic_refit.kernels.quantize import quantize_reference

    from elastic_refit.testing.pattern import allocate, check_quantized, finite_values

    held = destination_format_layout(SPEC.destination, FORMATS)
    buffers = allocate(held, 3, fill=0)
    assert len(check_quantized(SPEC.destination, FORMATS, 3, buffers, seed=7, limit=100)) == 5  # 5 pieces, all zero
    # rank 3: columns 144..287 of q (block columns 1 and 2), expert 1 of up, norm whole
    q = finite_values("q.weight", (320, 288), "bfloat16", (0, 0), (320, 288), seed=7)
    assert torch.isfinite(q.float()).all() and q.float().abs().max() > 1 and q.float().abs().min() < 2 ** -8
    fp8, scales = quantize_reference(q, FORMATS.of("q.weight"))
    buffers["q.weight"].copy_(fp8[:, 144:])
    buffers["q.weight_scale_inv"].copy_(scales[:, 1:])
    up = finite_values("up.weight", (2, 96, 80), "bfloat16", (0, 0, 0), (2, 96, 80), seed=7)
    fp8, scales = quantize_reference(up, FORMATS.of("up.weight"))
    buffers["up.weight"].copy_(fp8[1:])
    buffers["up.weight_scale"].copy_(scales[1:])
    buffers["norm.weight"].copy_(finite_values("norm.weight", (288,), "bfloat16", (0,), (288,), seed=7))
    assert check_quantized(SPEC.destination, FORMATS, 3, buffers, seed=7) == []
    assert check_quantized(SPEC.destination, FORMATS, 3, buffers, seed=8)  # another version's bytes differ
    buffers["q.weight_scale_inv"][2, 0] *= 2
    problems = check_quantized(SPEC.destination, FORMATS, 3, buffers, seed=7)
    assert len(problems) == 1 and problems[0].startswith("rank 3 tensor 'q.weight_scale_inv' piece [0:3, 1:3]")
