"""Per-rank plans from symbolic layouts equal the explicit planner's rank slices (issue 40)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from elastic_refit.layout import Topology
from elastic_refit.layout.symbolic_build import SymbolicBuilder
from elastic_refit.layout.symbolic_presets import megatron_symbolic, vllm_symbolic
from elastic_refit.plan import PlanOptions, make_plan, plan_input_fingerprint, rank_slice
from elastic_refit.plan.rank_rules import make_rank_plan_from_rules

_SAME = ("kind", "phase", "src_side", "src_rank", "dst_rank", "tensor", "offsets", "lengths", "nbytes", "instances",
         "round", "message", "message_offset")


def _piece_ids(layout, pieces: np.ndarray) -> dict[str, np.ndarray]:
    """Pieces as what they are (tensor, rank, buffer, global and local boxes), not as row
    numbers; -1 (no piece) stays -1. Vectorized: a view of a large model names ~500k."""
    pieces = np.asarray(pieces, dtype=np.int64)
    rows = np.maximum(pieces, 0)
    none = pieces < 0
    buf = layout.piece_buffer[rows]
    tensor_ndim = np.array([len(t.shape) for t in layout.tensors], dtype=np.int64)[layout.piece_tensor[rows]]
    out = {"none": none,
           "tensor": np.where(none, "", np.array([t.name for t in layout.tensors], dtype=object)[layout.piece_tensor[rows]]),
           "rank": np.where(none, -1, layout.buffer_rank[buf]),
           "buffer": np.where(none, "", np.array(layout.buffer_names, dtype=object)[layout.buffer_name[buf]])}
    for name, ndim in (("offsets", tensor_ndim), ("lengths", tensor_ndim),
                       ("local_offsets", layout.buffer_ndim[buf]), ("local_lengths", layout.buffer_ndim[buf])):
        column = getattr(layout, f"piece_{name}")[rows]
        # the dims a piece has; the padding past them is the layout's, not the piece's
        column = np.where((np.arange(column.shape[1]) < ndim[:, None]) & ~none[:, None], column, 0)
        out[name] = column
    return out


def _assert_same_pieces(got_layout, got: np.ndarray, want_layout, want: np.ndarray) -> None:
    got_ids, want_ids = _piece_ids(got_layout, got), _piece_ids(want_layout, want)
    for name, column in want_ids.items():
        other = got_ids[name]
        if column.ndim == 2:  # the layouts' widths may differ: compare over the wider
            width = max(column.shape[1], other.shape[1])
            column, other = (np.pad(c, ((0, 0), (0, width - c.shape[1]))) for c in (column, other))
        assert np.array_equal(other, column), name


def _assert_view_is_slice(view, want) -> None:
    got_t, want_t = view.transfers, want.transfers
    assert len(got_t) == len(want_t)
    for name in _SAME:
        assert np.array_equal(getattr(got_t, name), getattr(want_t, name)), name
    from_dst = want_t.src_side != 0
    for got_side, want_side, column, rows in (
            (view.source, want.source, "src_piece", ~from_dst), (view.destination, want.destination, "src_piece", from_dst),
            (view.destination, want.destination, "dst_piece", np.ones(len(want_t), dtype=bool))):
        _assert_same_pieces(got_side, getattr(got_t, column)[rows], want_side, getattr(want_t, column)[rows])
    # every copy of a class member too (the view's layouts hold the members' pieces)
    got_x, want_x = view.expand(), want.expand()
    assert np.array_equal(got_x.tensor, want_x.tensor)
    assert np.array_equal(got_x.message_offset, want_x.message_offset)
    _assert_same_pieces(view.destination, got_x.dst_piece, want.destination, want_x.dst_piece)
    x_from_dst = from_dst[want_x.row]
    for side_got, side_want, rows in ((view.source, want.source, ~x_from_dst), (view.destination, want.destination,
                                                                              x_from_dst)):
        _assert_same_pieces(side_got, got_x.src_piece[rows], side_want, want_x.src_piece[rows])


def _check_all_ranks(src, dst, topo, options, ranks=None) -> None:
    full = make_plan(src.to_layout(), dst.to_layout(), topo, options)
    if full.relayed:  # as make_rank_plan: refused
        with pytest.raises(ValueError, match="relayed"):
            make_rank_plan_from_rules(src, dst, topo, options, rank=0)
        return
    fingerprint = plan_input_fingerprint(src.to_layout(), dst.to_layout(), topo, options)
    for rank in (range(topo.num_ranks) if ranks is None else ranks):
        view = make_rank_plan_from_rules(src, dst, topo, options, rank=rank)
        want = rank_slice(full, rank)
        assert view.fingerprint == fingerprint
        assert view.num_rounds == want.num_rounds
        _assert_view_is_slice(view, want)


PRESETS = [
    ("llama-3.1-8b", "tp=2,pp=2,dp=2", "tp=4,dp=2", 4),
    ("qwen3-30b-a3b", "tp=2,pp=3,dp=2,ep=4", "tp=1,dp=3,ep=3", 4),
    ("qwen3-235b-a22b", "tp=4,pp=2,dp=1", "tp=16,dp=1", 8),
    ("deepseek-v3", "tp=2,pp=2,dp=4,ep=8", "tp=4,dp=2", 4),
    ("kimi-k2", "tp=1,pp=2,dp=8,ep=8", "tp=4,dp=4", 8),
]


@pytest.mark.parametrize(("model", "training", "inference", "domain_size"), PRESETS)
def test_rank_plans_from_rules_equal_the_explicit_slices(model, training, inference, domain_size):
    src = megatron_symbolic(model, training)
    n = src.to_layout().ranks[-1] + 1
    dst = vllm_symbolic(model, inference, first_rank=n)
    topo = Topology.uniform(n + dst.to_layout().ranks[-1] + 1 - n, domain_size)
    ranks = sorted({0, 1, n // 2, n - 1, n, n + 1, topo.num_ranks - 1})
    _check_all_ranks(src, dst, topo, PlanOptions(relay="off"), ranks)
    _check_all_ranks(src, dst, topo, PlanOptions(relay="auto", bucket_bytes=1 << 24), ranks[:3])


def test_colocated_sides_hold_demands_in_the_domain():
    src = megatron_symbolic("llama-3.1-8b", "tp=2,pp=2,dp=2")
    dst = vllm_symbolic("llama-3.1-8b", "tp=4,dp=2")  # the same ranks: local and intra copies
    _check_all_ranks(src, dst, Topology.uniform(8, 4), PlanOptions(relay="off"))


@st.composite
def _sides(draw):
    """Two sides of a few tensors on random meshes with random DTensor placements."""
    shapes = [tuple(draw(st.integers(1, 9)) for _ in range(draw(st.integers(1, 2)))) for _ in range(draw(st.integers(1, 3)))]
    sides = []
    for _ in range(2):
        b = SymbolicBuilder()
        for i, shape in enumerate(shapes):
            mesh_shape = tuple(draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 2))))
            size = int(np.prod(mesh_shape))
            first = draw(st.integers(0, 12 - size))
            ranks = np.arange(first, first + size)
            if draw(st.booleans()):
                ranks = np.array(draw(st.permutations(ranks.tolist())))
            placements = []
            for _ in mesh_shape:
                kind = draw(st.sampled_from(["R", "S", "_S"]))
                dim = draw(st.integers(0, len(shape) - 1))
                placements.append("R" if kind == "R" else f"S({dim})" if kind == "S"
                                  else f"_S({dim}, {draw(st.integers(1, 3))})")
            b.sharded_tensor(f"t{i}", shape, "float32", ranks.reshape(mesh_shape), placements)
        sides.append(b.build())
    domains = draw(st.one_of(st.sampled_from([1, 2, 4]), st.lists(st.integers(0, 3), min_size=12, max_size=12)))
    return sides[0], sides[1], domains, draw(st.sampled_from(["off", "auto"]))


@settings(max_examples=40, deadline=None)
@given(_sides())
def test_random_meshes_and_placements(case):
    src, dst, domains, relay = case  # uniform domains of a size, or any domain per rank
    topo = Topology.uniform(12, domains) if isinstance(domains, int) else Topology(tuple(domains))
    options = PlanOptions(relay=relay)
    try:
        full = make_plan(src.to_layout(), dst.to_layout(), topo, options)
    except ValueError as error:  # refused alike (the message may name other ranks of the region)
        event("refused")
        with pytest.raises(type(error)):
            make_rank_plan_from_rules(src, dst, topo, options, rank=0)
        return
    if full.relayed:
        with pytest.raises(ValueError, match="relayed"):
            make_rank_plan_from_rules(src, dst, topo, options, rank=0)
        return
    event(f"planned, {len(full.transfers)} rows" if len(full.transfers) < 8 else "planned, 8+ rows")
    for rank in range(topo.num_ranks):
        _assert_view_is_slice(make_rank_plan_from_rules(src, dst, topo, options, rank=rank), rank_slice(full, rank))


def test_plan_rank_cli_plans_from_rules_as_from_explicit_layouts(capsys):
    import json

    from elastic_refit import cli

    case = ["plan", "--model", "qwen3-30b-a3b", "--source", "tp=2,pp=2,dp=2,ep=4", "--destination", "tp=2,dp=4",
            "--domain-size", "4", "--rank", "9", "--json"]
    assert cli.main(case) == 0
    rules = json.loads(capsys.readouterr().out)
    assert cli.main([*case, "--explicit-layouts"]) == 0
    explicit = json.loads(capsys.readouterr().out)
    assert (rules["layouts"], explicit["layouts"]) == ("rules", "explicit")
    for name in ("layout_seconds", "plan_seconds", "peak_rss_bytes", "layouts"):
        rules.pop(name), explicit.pop(name)
    assert rules == explicit and rules["recv_bytes"] > 0
