"""Symbolic layouts (rules) against the explicit constructors: identical rows, fingerprints,
per-rank derivations and plans."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_refit.layout import (
    LayoutBuilder,
    Topology,
    add_sharded_tensor,
    megatron_layout,
    vllm_layout,
)
from elastic_refit.layout.symbolic import Mesh
from elastic_refit.layout.symbolic_build import SymbolicBuilder
from elastic_refit.layout.symbolic_presets import megatron_symbolic, vllm_symbolic
from elastic_refit.plan import make_plan

from .explicit_presets import megatron_explicit, vllm_explicit

_COLUMNS = ("buffer_rank", "buffer_name", "buffer_shape", "buffer_ndim", "buffer_dtype", "piece_tensor",
            "piece_buffer", "piece_offsets", "piece_lengths", "piece_local_offsets", "piece_local_lengths")


def assert_same_rows(a, b):
    assert a.tensors == b.tensors
    assert a.buffer_names == b.buffer_names
    for name in _COLUMNS:
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


@st.composite
def sharded_tensors(draw):
    """A few tensors, each on a random mesh (ranks permuted, shifted) with random placements
    (Shard, _StridedShard, Replicate; uneven sizes and empty shards included)."""
    out = []
    for i in range(draw(st.integers(1, 4))):
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.integers(1, 13)) for _ in range(ndim))
        mesh_shape = tuple(draw(st.integers(1, 4)) for _ in range(draw(st.integers(1, 3))))
        size = int(np.prod(mesh_shape))
        first = draw(st.integers(0, 5))
        ranks = np.arange(first, first + size) * draw(st.sampled_from([1, 2]))
        if draw(st.booleans()):
            ranks = np.array(draw(st.permutations(ranks.tolist())))
        placements = []
        for _ in mesh_shape:
            kind = draw(st.sampled_from(["R", "S", "_S"]))
            dim = draw(st.integers(0, ndim - 1))
            placements.append("R" if kind == "R" else f"S({dim})" if kind == "S"
                              else f"_S({dim}, {draw(st.integers(1, 3))})")
        out.append((f"t{i}", shape, ranks.reshape(mesh_shape), placements))
    return out


@settings(max_examples=60, deadline=None)
@given(sharded_tensors())
def test_dtensor_rules_give_the_explicit_rows_fingerprint_and_rank_slices(tensors):
    explicit, symbolic = LayoutBuilder(), SymbolicBuilder()
    for name, shape, mesh, placements in tensors:
        add_sharded_tensor(explicit, name, shape, "float32", mesh, placements)
        symbolic.sharded_tensor(name, shape, "float32", mesh, placements)
    want, got = explicit.build(), symbolic.build()
    assert_same_rows(want, got.to_layout())
    assert got.fingerprint == want.fingerprint
    for r in range(int(max(m.max() for _, _, m, _ in tensors)) + 2):
        assert_same_rows(want.restrict_to_ranks([r]), got.layout_of_ranks([r]))


PRESETS = [
    ("llama-3.1-8b", "tp=2,pp=2,dp=2", "tp=4,dp=2"),
    ("qwen3-30b-a3b", "tp=2,pp=3,dp=2,ep=4", "tp=1,dp=3,ep=3"),  # 128 experts over 3: uneven
    ("qwen3-235b-a22b", "tp=4,pp=2,dp=1", "tp=16,dp=1"),  # kv heads replicated over tp
    ("deepseek-v3", "tp=2,pp=2,dp=4,ep=8", "tp=4,dp=2"),
    ("kimi-k2", "tp=1,pp=2,dp=8,ep=8", "tp=4,dp=2,ep=8"),
]


@pytest.mark.parametrize(("model", "training", "inference"), PRESETS)
def test_preset_rules_give_the_explicit_presets(model, training, inference):
    """The rules (which the library's presets build from) against the presets built piece by
    piece (``explicit_presets``, the oracle), and the library's presets are the rules'."""
    pairs = [(megatron_explicit(model, training, num_layers=4), megatron_symbolic(model, training, num_layers=4)),
             (vllm_explicit(model, inference, first_rank=3, num_layers=4),
              vllm_symbolic(model, inference, first_rank=3, num_layers=4))]
    for want, got in pairs:
        assert_same_rows(want, got.to_layout())
        assert got.fingerprint == want.fingerprint
    assert_same_rows(megatron_layout(model, training, num_layers=4), pairs[0][0])
    assert_same_rows(vllm_layout(model, inference, first_rank=3, num_layers=4), pairs[1][0])
    for want, got in pairs:
        for r in (want.ranks[0], want.ranks[-1], want.ranks[len(want.ranks) // 2]):
            assert_same_rows(want.restrict_to_ranks([r]), got.layout_of_ranks([r]))


def test_flattened_moe_tp_and_plans_agree():
    src = megatron_symbolic("qwen3-30b-a3b", "tp=2,pp=2,dp=2,ep=4", num_layers=2)
    dst = vllm_symbolic("qwen3-30b-a3b", "tp=2,dp=2", first_rank=8, num_layers=2, flatten_moe_tp=True)
    want_dst = vllm_explicit("qwen3-30b-a3b", "tp=2,dp=2", first_rank=8, num_layers=2, flatten_moe_tp=True)
    assert dst.fingerprint == want_dst.fingerprint
    topology = Topology.uniform(12, 4)
    a = make_plan(src.to_layout(), dst.to_layout(), topology)
    b = make_plan(megatron_explicit("qwen3-30b-a3b", "tp=2,pp=2,dp=2,ep=4", num_layers=2), want_dst, topology)
    assert a.fingerprint == b.fingerprint
    assert a.stats.cross_domain_bytes == a.stats.lower_bound_bytes


def test_fingerprint_ignores_how_rules_spell_a_mesh_but_not_the_ranks():
    def one(mesh, placements):
        b = SymbolicBuilder()
        b.sharded_tensor("w", (8, 4), "bfloat16", mesh, placements)
        return b.build()

    affine = one(Mesh((2, 2), 4, (2, 1)), ["S(0)", "S(1)"])
    table = one(Mesh((2, 2), table=(4, 5, 6, 7)), ["S(0)", "S(1)"])
    assert affine.fingerprint == table.fingerprint
    assert one(Mesh((2, 2), 5, (2, 1)), ["S(0)", "S(1)"]).fingerprint != affine.fingerprint
    # pieces equal, buffers equal: one strided shard of factor 1 is a Shard
    assert one(Mesh((4,), 4), ["_S(0, 1)"]).fingerprint == one(Mesh((4,), 4), ["S(0)"]).fingerprint


def test_mesh_decodes_ranks_and_refuses_overlaps():
    mesh = Mesh((3, 2), 10, (4, 1))
    ranks = mesh.ranks(np.arange(6))
    assert ranks.tolist() == [10, 11, 14, 15, 18, 19]
    assert mesh.positions_of(np.array([10, 15, 12, 19, 9, 22])).tolist() == [0, 3, -1, 5, -1, -1]
    assert Mesh.of(np.array([[3, 1], [0, 2]])).table == (3, 1, 0, 2)
    assert Mesh.of(np.array([[5, 6], [9, 10]])) == Mesh((2, 2), 5, (4, 1))
    with pytest.raises(ValueError, match="lists a rank twice"):
        Mesh((2, 2), 0, (1, 1))


def test_symbolic_encoding_round_trips_is_small_and_checks_the_fingerprint():
    from elastic_refit.layout.encoding import decode_symbolic, encode_symbolic

    layout = vllm_symbolic("kimi-k2", "tp=16,dp=256", first_rank=4096)  # 4,096 ranks
    blob = encode_symbolic(layout)
    assert len(blob) < 64 << 10
    back = decode_symbolic(blob, layout.fingerprint)
    assert back.fingerprint == layout.fingerprint
    assert_same_rows(back.layout_of_ranks([5000]), layout.layout_of_ranks([5000]))
    with pytest.raises(ValueError, match=r"expected 0+$"):
        decode_symbolic(blob, "0" * 32)
    with pytest.raises(ValueError, match="bad magic"):
        decode_symbolic(b"ERL1" + blob[4:])
    # an explicit part travels with the rules
    b = SymbolicBuilder()
    b.sharded_tensor("w", (6, 2), "float32", [0, 1], ["S(0)"])
    b.tensor("x", (3,), "float32")
    b.explicit.pieces("x", b.explicit.buffers("x", [1], (3,), "float32"), [[0]], [[3]], [[0]])
    mixed = b.build()
    want = LayoutBuilder()
    add_sharded_tensor(want, "w", (6, 2), "float32", [0, 1], ["S(0)"])
    want.tensor("x", (3,), "float32")
    want.pieces("x", want.buffers("x", [1], (3,), "float32"), [[0]], [[3]], [[0]])
    assert_same_rows(want.build(), decode_symbolic(encode_symbolic(mixed)).to_layout())
    assert mixed.fingerprint == want.build().fingerprint


def test_erl3_carries_destination_formats_under_the_described_fingerprint():
    from elastic_refit.layout import TensorFormats, decode_described, described_fingerprint
    from elastic_refit.layout.encoding import decode_symbolic_described, encode_symbolic
    from elastic_refit.layout.symbolic import rules_of

    side = vllm_symbolic("qwen3-30b-a3b", "tp=2,dp=2")
    formats = TensorFormats.from_mapping({"model.layers.1.mlp.experts.down_proj.weight": "fp8-block128"})
    blob = encode_symbolic(side, formats)
    described = described_fingerprint(side, formats)
    assert described != side.fingerprint
    rules, got = decode_symbolic_described(blob, described)
    assert rules.fingerprint == side.fingerprint and got == formats
    layout, got = decode_described(blob, described)  # ERL3 read as pieces, as ERL1/2 are
    assert got == formats and layout.fingerprint == side.fingerprint and rules_of(layout) is not None
    assert_same_rows(layout, vllm_explicit("qwen3-30b-a3b", "tp=2,dp=2"))
    with pytest.raises(ValueError, match="expected"):
        decode_symbolic_described(blob, side.fingerprint)  # the formats are part of the description
    assert decode_symbolic_described(encode_symbolic(side), side.fingerprint)[1] == TensorFormats()
    # a layout derived from one built from rules is not those rules
    assert rules_of(layout.without_ranks([0])) is None
