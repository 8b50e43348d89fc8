"""The layout language: DTensor parity, real DTensors, validation messages, spec files.

Errors are user-facing (the CLI prints them verbatim), so every ``ValueError`` is checked
with ``match=`` on the values it must quote, not just its type.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_refit.layout import (
    Box,
    Layout,
    LayoutBuilder,
    LogicalTensor,
    Replicate,
    Shard,
    Topology,
    add_sharded_tensor,
    canonical_dtype,
    from_dtensors,
    load_spec,
    parse_placement,
    parse_spec,
    shard_boxes,
)

# ---- DTensor parity ------------------------------------------------------------------------


@st.composite
def sharding_cases(draw):
    """1-3 mesh axes of size 1-4, 1-3 dims of size 0-9 (so dims smaller than a mesh axis and
    empty shards are common), placements that often shard the same dim on several axes."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(0, 9)) for _ in range(ndim))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    placements = [draw(st.one_of(st.none(), st.integers(0, ndim - 1))) for _ in mesh_shape]
    return shape, mesh_shape, placements


def _torch_placements(placements):
    from torch.distributed.tensor.placement_types import Replicate as TR
    from torch.distributed.tensor.placement_types import Shard as TS

    return [TR() if p is None else TS(p) for p in placements]


@settings(max_examples=400, deadline=None)
@given(sharding_cases())
def test_shard_boxes_match_torch_for_every_mesh_coordinate(case):
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    shape, mesh_shape, placements = case
    ours = [Replicate() if p is None else Shard(p) for p in placements]
    offsets, lengths = shard_boxes(shape, mesh_shape, ours)
    assert offsets.shape == lengths.shape == (int(np.prod(mesh_shape)), len(shape))
    # Dims split by more than one mesh axis: see the empty-shard note below.
    nested = {d for d in set(placements) - {None} if placements.count(d) > 1}
    coords = itertools.product(*(range(m) for m in mesh_shape))  # row-major, like shard_boxes
    for i, coord in enumerate(coords):
        local_shape, global_offset = _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coord), _torch_placements(placements))
        assert tuple(lengths[i]) == tuple(local_shape), (coord, offsets[i], lengths[i])
        if all(n > 0 for n in local_shape):
            assert tuple(offsets[i]) == tuple(global_offset), (coord, offsets[i], lengths[i])
            continue
        # Empty shards. torch puts the offset of an empty sharded dim at the global size of
        # that dim. shard_boxes agrees when one mesh axis splits the dim, but when several
        # axes split it (nested chunking) it reports the end of the parent shard instead,
        # e.g. shape (6,), mesh (3, 4), [S(0), S(0)], coord (0, 2): torch 6, ours 2.
        # Empty pieces are dropped by LayoutBuilder.build, so this never reaches a plan;
        # we pin both conventions so a change on either side is noticed.
        for d in range(len(shape)):
            if d in nested and local_shape[d] == 0:
                assert global_offset[d] == shape[d]
                assert 0 <= offsets[i, d] <= shape[d]
            else:
                assert offsets[i, d] == global_offset[d], (coord, d, offsets[i], global_offset)


def test_nested_empty_shard_offset_differs_from_torch_as_documented():
    """The concrete case quoted above: pins the (harmless) difference explicitly."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    offsets, lengths = shard_boxes((6,), (3, 4), [Shard(0), Shard(0)])
    _, torch_offset = _compute_local_shape_and_global_offset((6,), (3, 4), [0, 2], _torch_placements([0, 0]))
    assert lengths[2, 0] == 0
    assert torch_offset == (6,)
    assert offsets[2, 0] == 2


def test_shard_boxes_cover_each_element_once_per_replica_group():
    """Independent of torch: a fully sharded dim is tiled without gaps or overlap."""
    offsets, lengths = shard_boxes((10, 3), (3, 2), [Shard(0), Shard(0)])
    counts = np.zeros(10, dtype=int)
    for o, n in zip(offsets[:, 0], lengths[:, 0], strict=True):
        counts[o : o + n] += 1
    assert counts.tolist() == [1] * 10
    assert lengths[:, 1].tolist() == [3] * 6


# ---- from_dtensors with real DTensors (torch's fake process group) --------------------------


@pytest.fixture
def fake_world():
    """A 4-rank world in one process: the fake backend runs no collectives, but DeviceMesh
    and DTensor are the real classes."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():  # pragma: no cover - another test leaked a group
        dist.destroy_process_group()
    store = FakeStore()  # keep a Python reference for the group's lifetime (DESIGN pitfall)
    dist.init_process_group("fake", store=store, rank=0, world_size=4)
    try:
        yield store
    finally:
        dist.destroy_process_group()


def _pieces_as_rows(layout):
    return sorted((p.tensor, p.rank, p.buffer, p.box, p.local_box) for p in layout.pieces())


def test_from_dtensors_matches_add_sharded_tensor(fake_world):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.placement_types import Replicate as TR
    from torch.distributed.tensor.placement_types import Shard as TS

    mesh2d = [[2, 0], [3, 1]]  # a permuted mesh: rank ids are not mesh positions
    m2 = DeviceMesh("cpu", mesh2d)
    m1 = DeviceMesh("cpu", [0, 1, 2, 3])
    # Uneven: 7 rows over 2x2 nested shards; 3 columns over 4 ranks (one empty shard).
    a = distribute_tensor(torch.zeros(7, 5, dtype=torch.bfloat16), m2, [TS(0), TS(0)])
    b = distribute_tensor(torch.zeros(4, 3), m1, [TS(1)])
    c = DTensor.from_local(torch.zeros(3, 2, 6), m2, [TR(), TS(2)], run_check=False,
                           shape=torch.Size([3, 2, 11]), stride=(22, 11, 1))
    got = from_dtensors({"a": a, "b": b, "c": c}).build()

    want = LayoutBuilder()
    add_sharded_tensor(want, "a", (7, 5), "bfloat16", mesh2d, ["S(0)", "S(0)"])
    add_sharded_tensor(want, "b", (4, 3), "float32", [0, 1, 2, 3], ["S(1)"])
    add_sharded_tensor(want, "c", (3, 2, 11), "float32", mesh2d, ["R", "S(2)"])
    want = want.build()
    assert _pieces_as_rows(got) == _pieces_as_rows(want)
    assert got.fingerprint == want.fingerprint
    # The fake backend's rank-0 shard of "a" is what torch says rank 0 owns: mesh[0][1] = 0.
    (p0,) = [p for p in got.pieces("a") if p.rank == 0]
    assert p0.box.lengths[0] == a.to_local().shape[0]
    assert {p.rank for p in got.pieces("b")} == {0, 1, 2}  # rank 3's shard of 3 columns is empty


def test_from_dtensors_rejects_partial_and_non_dtensors(fake_world):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Partial
    from torch.distributed.tensor.placement_types import Replicate as TR

    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    pending = DTensor.from_local(torch.zeros(2, 3), mesh, [TR(), Partial()], run_check=False,
                                 shape=torch.Size([2, 3]), stride=(3, 1))
    with pytest.raises(ValueError, match=re.escape(
            "tensor 'grad_sum': placement P(sum) is not supported (only Shard and Replicate)")):
        from_dtensors([("grad_sum", pending)])
    # A strided shard (FSDP2 over TP) has its own layout, not Shard's: rows 0, 2 on mesh row 0
    # (tests/unit/test_dtensor.py checks it against torch on random meshes).
    from torch.distributed.tensor.placement_types import _StridedShard

    strided = DTensor.from_local(torch.zeros(2, 3), mesh, [_StridedShard(0, split_factor=2), TR()],
                                 run_check=False, shape=torch.Size([4, 3]), stride=(3, 1))
    layout = from_dtensors({"fsdp_tp": strided}).build()
    rows = sorted((p.rank, p.box.offsets[0], p.local_box.offsets[0]) for p in layout.pieces("fsdp_tp"))
    assert rows == [(0, 0, 0), (0, 2, 1), (1, 0, 0), (1, 2, 1), (2, 1, 0), (2, 3, 1), (3, 1, 0), (3, 3, 1)]
    with pytest.raises(ValueError, match=r"'plain' is a Tensor, not a DTensor"):
        from_dtensors({"plain": torch.zeros(2)})


# ---- Box, dtype, LogicalTensor, Topology -----------------------------------------------------


def test_box_validation_messages_quote_values():
    with pytest.raises(ValueError, match=re.escape("box offsets (0, 1) and lengths (2,) differ in rank")):
        Box((0, 1), (2,))
    with pytest.raises(ValueError, match=re.escape("box offsets (0, -1) and lengths (2, 2) must be >= 0")):
        Box((0, -1), (2, 2))
    with pytest.raises(ValueError, match=re.escape("must be >= 0")):
        Box((0,), (-3,))
    with pytest.raises(ValueError, match=r"box offsets must be a sequence of integers, got 5"):
        Box(5, (1,))
    with pytest.raises(ValueError, match=r"box lengths must be integers, got \(1\.5,\)"):
        Box((0,), (1.5,))
    with pytest.raises(ValueError, match=r"box offsets must be integers, got \(True,\)"):
        Box((True,), (1,))
    with pytest.raises(ValueError, match="cannot intersect boxes of rank 1 and 2"):
        Box((0,), (1,)).intersect(Box((0, 0), (1, 1)))
    with pytest.raises(ValueError, match=r"unknown dtype 'float7'; known: float64, float32"):
        canonical_dtype("float7")


def test_box_geometry():
    a, b = Box((0, 2), (4, 4)), Box((3, 5), (4, 4))
    assert a.intersect(b) == Box((3, 5), (1, 1))
    assert a.intersect(Box((4, 0), (1, 1))) is None  # touching faces do not overlap
    assert a.contains(Box((1, 3), (2, 2))) and not a.contains(b)
    assert a.fits((4, 6)) and not a.fits((4, 5))
    assert Box((0,), (0,)).is_empty and a.numel == 16 and a.ends == (4, 6)
    assert str(a) == "[0:4, 2:6]"
    assert Box(np.array([1]), np.array([2])) == Box((1,), (2,))  # numpy ints normalised
    assert canonical_dtype(torch.bfloat16) == canonical_dtype("bf16") == "bfloat16"


def test_logical_tensor_and_topology_validation():
    with pytest.raises(ValueError, match="tensor name must be a non-empty string, got ''"):
        LogicalTensor("", (1,), "float32")
    with pytest.raises(ValueError, match=re.escape("tensor 'w': shape must be non-empty and >= 0, got (4, -1)")):
        LogicalTensor("w", (4, -1), "float32")
    with pytest.raises(ValueError, match=re.escape("tensor 'w': shape must be non-empty and >= 0, got ()")):
        LogicalTensor("w", (), "float32")
    with pytest.raises(ValueError, match="unknown dtype 'complex32'"):
        LogicalTensor("w", (1,), "complex32")
    with pytest.raises(ValueError, match="topology needs at least one rank"):
        Topology(())
    with pytest.raises(ValueError, match=re.escape("domain ids must be >= 0, got [-2, 0]")):
        Topology((0, -2, 0))
    with pytest.raises(ValueError, match="topology has 3 domains but 2 hosts"):
        Topology((0, 0, 1), hosts=("a", "b"))
    with pytest.raises(ValueError, match="domain size must be >= 1, got 0"):
        Topology.uniform(8, 0)
    with pytest.raises(ValueError, match="number of ranks must be >= 1, got 0"):
        Topology.uniform(0, 8)
    topo = Topology.uniform(10, 4)
    assert topo.domains == (0, 0, 0, 0, 1, 1, 1, 1, 2, 2)
    assert topo.num_domains == 3 and topo.hosts[9] == "domain-2"
    assert topo.fingerprint() == Topology.uniform(10, 4).fingerprint() != Topology.uniform(10, 5).fingerprint()


# ---- LayoutBuilder validation ------------------------------------------------------------


def _builder_with(shape=(4, 6), buf_shape=(4, 6), dtype="float32", buf_dtype=None, rank=3):
    b = LayoutBuilder()
    t = b.tensor("w", shape, dtype)
    ids = b.buffers("w_buf", [rank], buf_shape, buf_dtype or dtype)
    return b, t, ids


def test_builder_declaration_errors():
    b = LayoutBuilder()
    b.tensor("w", (4, 6), "float32")
    assert b.tensor("w", (4, 6), "fp32") == 0  # identical redeclaration is idempotent
    with pytest.raises(ValueError, match=re.escape(
            "tensor 'w' declared twice with different shape/dtype: (4, 6) float32 vs (4, 7) float32")):
        b.tensor("w", (4, 7), "float32")
    with pytest.raises(ValueError, match="buffer 'x': 2 shapes for 3 ranks"):
        b.buffers("x", [0, 1, 2], [[1], [2]], "float32")
    with pytest.raises(ValueError, match="buffer 'x': ranks and shapes must be >= 0"):
        b.buffers("x", [-1], [4], "float32")
    with pytest.raises(ValueError, match="buffer 'x': ranks and shapes must be >= 0"):
        b.buffers("x", [0], [-4], "float32")
    ids = b.buffers("w", [0, 1], [4, 6], "float32")
    with pytest.raises(ValueError, match="unknown tensor id 7"):
        b.pieces(7, ids, [[0, 0]] * 2, [[4, 6]] * 2, [[0, 0]] * 2)
    with pytest.raises(ValueError, match="tensor 'w': 1 offsets for 2 pieces"):
        b.pieces("w", ids, [[0, 0]], [[4, 6]] * 2, [[0, 0]] * 2)
    with pytest.raises(ValueError, match="tensor 'w': 3 local lengths for 2 pieces"):
        b.pieces("w", ids, [[0, 0]] * 2, [[4, 6]] * 2, [[0, 0]] * 2, [[4, 6]] * 3)
    with pytest.raises(ValueError, match=r"tensor 'w': local boxes of rank 1 need explicit local lengths \(global rank 2\)"):
        b.pieces("w", ids, [[0, 0]] * 2, [[4, 6]] * 2, [[0]] * 2)


def test_builder_pieces_unknown_tensor_name_is_value_error():
    b, _, ids = _builder_with()
    with pytest.raises(ValueError, match="nope"):
        b.pieces("nope", ids, [[0, 0]], [[4, 6]], [[0, 0]])


def test_builder_build_errors_name_tensor_rank_and_buffer():
    where = "tensor 'w' on rank 3 (buffer 'w_buf')"
    b = LayoutBuilder()
    b.buffers("dup", [2, 2], [1], "float32")
    with pytest.raises(ValueError, match="buffer 'dup' declared twice on rank 2"):
        b.build()

    b, t, _ = _builder_with()
    b.pieces(t, [5], [[0, 0]], [[1, 1]], [[0, 0]])
    with pytest.raises(ValueError, match="piece refers to an unknown buffer id"):
        b.build()

    b, t, ids = _builder_with()
    b.pieces(t, ids, [[0, -1]], [[1, 1]], [[0, 0]])
    with pytest.raises(ValueError, match=re.escape(f"{where}: negative box [0, -1]+[1, 1]")):
        b.build()

    b, t, ids = _builder_with()
    b.pieces(t, ids, [[2, 0]], [[3, 6]], [[0, 0]], [[3, 6]])
    with pytest.raises(ValueError, match=re.escape(f"{where}: box [2:5, 0:6] is out of bounds of shape (4, 6)")):
        b.build()

    b, t, ids = _builder_with(buf_shape=(2, 6))
    b.pieces(t, ids, [[0, 0]], [[4, 6]], [[0, 0]])
    with pytest.raises(ValueError, match=re.escape(f"{where}: local box [0, 0]+[4, 6] is out of bounds of buffer shape [2, 6]")):
        b.build()

    b, t, ids = _builder_with(buf_dtype="bfloat16")
    b.pieces(t, ids, [[0, 0]], [[4, 6]], [[0, 0]])
    with pytest.raises(ValueError, match=f"{re.escape(where)}: tensor dtype float32 differs from buffer dtype bfloat16"):
        b.build()

    b, t, ids = _builder_with(buf_shape=(24,))
    b.pieces(t, ids, [[0, 0]], [[4, 6]], [[0]], [[24]])  # a flattening is not a squeeze
    with pytest.raises(ValueError, match=re.escape(f"{where}: global extents [4, 6] and local extents [24, 1] differ beyond size-1 dims")):
        b.build()

    b, t, ids = _builder_with(buf_shape=(6, 4))
    b.pieces(t, ids, [[0, 0]], [[4, 6]], [[0, 0]], [[6, 4]])  # a transpose is not a squeeze either
    with pytest.raises(ValueError, match="differ beyond size-1 dims"):
        b.build()


def test_dtensor_constructor_errors_name_tensor_and_values():
    with pytest.raises(ValueError, match="Shard dim must be an integer >= 0, got -1"):
        Shard(-1)
    with pytest.raises(ValueError, match="Shard dim must be an integer >= 0, got True"):
        Shard(True)
    with pytest.raises(ValueError, match=re.escape("unknown placement 'S(x)': use \"R\" or \"S(dim)\"")):
        parse_placement("S(x)")
    with pytest.raises(ValueError, match="unknown placement 3"):
        parse_placement(3)
    assert parse_placement(" Shard(dim=2) ") == Shard(2) and parse_placement("Replicate()") == Replicate()
    with pytest.raises(ValueError, match=re.escape("1 placements for a mesh with 2 axes (mesh shape (2, 2))")):
        shard_boxes((4,), (2, 2), [Shard(0)])
    with pytest.raises(ValueError, match=re.escape("placement S(2) on mesh axis 1 is out of range for shape (4, 4)")):
        shard_boxes((4, 4), (2, 2), [Replicate(), Shard(2)])
    b = LayoutBuilder()
    with pytest.raises(ValueError, match=r"tensor 'w': mesh must be a non-empty nested list of rank ids"):
        add_sharded_tensor(b, "w", (4,), "float32", [], ["S(0)"])
    with pytest.raises(ValueError, match=r"tensor 'w': mesh must be a non-empty nested list of rank ids"):
        add_sharded_tensor(b, "w", (4,), "float32", [0.5, 1.5], ["S(0)"])
    with pytest.raises(ValueError, match=re.escape("tensor 'w': mesh lists a rank twice: [[0, 1], [1, 2]]")):
        add_sharded_tensor(b, "w", (4,), "float32", [[0, 1], [1, 2]], ["R", "S(0)"])
    with pytest.raises(ValueError, match=re.escape("tensor 'w': mesh ranks must be >= 0: [0, -1]")):
        add_sharded_tensor(b, "w", (4,), "float32", [0, -1], ["S(0)"])


# ---- Layout: derived layouts, pieces, local regions, fingerprint -----------------------------


def _two_tensor_layout(extra_row: int = 0):
    b = LayoutBuilder()
    add_sharded_tensor(b, "w", (6, 4), "float32", [[0, 1], [2, 3]], ["S(0)", "S(1)"])
    add_sharded_tensor(b, "e", (3 + extra_row, 5), "bfloat16", [0, 1, 2, 3], ["S(0)"])  # rank 3: empty
    return b.build()


def test_pieces_rows_and_empty_shards_dropped():
    layout = _two_tensor_layout()
    w = sorted((p.rank, p.box.offsets, p.box.lengths) for p in layout.pieces("w"))
    assert w == [(0, (0, 0), (3, 2)), (1, (0, 2), (3, 2)), (2, (3, 0), (3, 2)), (3, (3, 2), (3, 2))]
    e = sorted((p.rank, p.box.offsets[0]) for p in layout.pieces("e"))
    assert e == [(0, 0), (1, 1), (2, 2)]  # rank 3's empty shard is not a piece
    assert layout.num_pieces == len(list(layout.pieces())) == 7
    assert {p.local_box.offsets for p in layout.pieces()} == {(0, 0)}
    assert layout.ranks == (0, 1, 2, 3)
    assert layout.model_nbytes == 6 * 4 * 4 + 3 * 5 * 2
    with pytest.raises(KeyError, match="layout has no tensor named 'nope'"):
        layout.tensor("nope")


def test_without_ranks_and_restrict_to_ranks_are_complements():
    layout = _two_tensor_layout()
    out = layout.without_ranks([1, 3])
    kept = layout.restrict_to_ranks([0, 2])
    assert out.ranks == kept.ranks == (0, 2)
    assert _pieces_as_rows(out) == _pieces_as_rows(kept)
    assert _pieces_as_rows(out) == [r for r in _pieces_as_rows(layout) if r[1] in (0, 2)]
    assert [b.rank for b in out.buffers()] == [0, 0, 2, 2]
    assert layout.without_ranks([]).fingerprint == layout.fingerprint
    assert layout.restrict_to_ranks([]).num_pieces == 0
    # Buffer ids are re-indexed: every piece still points at a buffer of its own rank.
    assert all(out.buffer(int(out.piece_buffer[i])).rank == out.piece(i).rank for i in range(out.num_pieces))


def test_local_regions_map_sub_boxes_through_squeezed_dims():
    """A [2, 1, 3] global box stored as a [3, 2] buffer region (a squeezed, reordered-rank
    view: the k-th dim > 1 of the global box is the k-th dim > 1 of the local box)."""
    b = LayoutBuilder()
    t = b.tensor("x", (4, 5, 6), "float32")
    (buf,) = b.buffers("fused", [7], (10, 3), "float32")
    b.pieces(t, [buf], [[1, 2, 3]], [[2, 1, 3]], [[5, 0]], [[2, 3]])
    (buf2,) = b.buffers("flat", [7], (1, 6), "float32")
    b.pieces(t, [buf2], [[0, 0, 0]], [[1, 1, 6]], [[0, 0]], [[1, 6]])
    layout = b.build()
    rows = {layout.piece(i).buffer: i for i in range(layout.num_pieces)}
    off, ln = layout.local_regions(np.array([rows["fused"], rows["fused"], rows["flat"]]),
                                   np.array([[2, 2, 4], [1, 2, 3], [0, 0, 2]]),
                                   np.array([[1, 1, 2], [2, 1, 1], [1, 1, 3]]))
    assert off[:, :2].tolist() == [[6, 1], [5, 0], [0, 2]]
    assert ln[:, :2].tolist() == [[1, 2], [2, 1], [1, 3]]
    # And the mapping is consistent with actually slicing the arrays.
    g = np.arange(4 * 5 * 6).reshape(4, 5, 6)
    local = np.zeros((10, 3), dtype=g.dtype)
    local[5:7, 0:3] = g[1:3, 2:3, 3:6].reshape(2, 3)
    assert np.array_equal(local[6:7, 1:3].reshape(-1), g[2:3, 2:3, 4:6].reshape(-1))


def test_fingerprint_stable_across_builds_and_sensitive_to_a_piece():
    a, b = _two_tensor_layout(), _two_tensor_layout()
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 32
    assert _two_tensor_layout(extra_row=1).fingerprint != a.fingerprint

    def one_piece(local_offset: int):
        bld = LayoutBuilder()
        t = bld.tensor("w", (4,), "float32")
        ids = bld.buffers("w", [0], (5,), "float32")
        bld.pieces(t, ids, [[0]], [[4]], [[local_offset]])
        return bld.build()

    assert one_piece(0).fingerprint == one_piece(0).fingerprint != one_piece(1).fingerprint


def _rebuilt(layout):
    """The layout from copies of its columns: nothing memoised or inherited."""
    return Layout(**{f.name: (np.array(v) if isinstance(v := getattr(layout, f.name), np.ndarray) else v)
                     for f in dataclasses.fields(Layout) if f.init})


def test_fingerprint_covers_every_column_and_the_row_order():
    base = _two_tensor_layout()
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Layout) if f.init}
    seen = {base.fingerprint}
    for name, value in fields.items():
        if isinstance(value, np.ndarray):
            changed = np.array(value)
            # (the last piece lives in the last buffer: point it at an earlier one)
            changed.reshape(-1)[-1] += -1 if name == "piece_buffer" else 1
        elif name == "tensors":
            changed = (LogicalTensor(value[0].name, value[0].shape, "float64"),) + value[1:]
        else:
            changed = ("renamed",) + value[1:]
        seen.add(Layout(**{**fields, name: changed}).fingerprint)
        assert len(seen) == 1 + list(fields).index(name) + 1, f"{name} is not covered"
    # Rows in another order are another layout (plans address pieces by row), also when
    # they leave the canonical order the fingerprint otherwise relies on.
    order = np.array([1, 0] + list(range(2, base.num_pieces)))
    swapped = {**fields, **{n: fields[n][order] for n in fields if n.startswith("piece_")}}
    assert Layout(**swapped).fingerprint not in seen


@settings(max_examples=40, deadline=None)
@given(st.permutations(range(5)), st.permutations(range(3)), st.booleans())
def test_declaration_order_does_not_change_the_layout(tensor_order, rank_order, buffers_first):
    """Two ranks (or sides) declaring one layout in different orders agree on every row
    and on the fingerprint."""
    shapes = [(8, 4), (6,), (3, 5, 2), (7, 2), (4,)]
    meshes = [[0, 1, 2], [2, 0], [1], [0, 1, 2], [2, 1]]

    def build(order, ranks):
        b = LayoutBuilder()
        if buffers_first:  # buffer names declared in another order than the tensors
            for i in reversed(order):
                b.tensor(f"t{i}", shapes[i], "float32")
        for i in order:
            t = b.tensor(f"t{i}", shapes[i], "float32")
            offsets, lengths = shard_boxes(shapes[i], [len(meshes[i])], [Shard(0)])
            positions = {r: p for p, r in enumerate(meshes[i])}
            for r in (r for r in ranks if r in positions):  # one rank at a time, in `ranks` order
                p = positions[r]
                ids = b.buffers(f"buf.{i}", [r], lengths[p], "float32")
                b.pieces(t, ids, offsets[p : p + 1], lengths[p : p + 1], np.zeros_like(offsets[p : p + 1]))
        return b.build()

    canonical = build(range(5), range(3))
    other = build(tensor_order, rank_order)
    assert other.fingerprint == canonical.fingerprint
    assert [t.name for t in other.tensors] == sorted(f"t{i}" for i in range(5))
    assert other.buffer_names == tuple(sorted(other.buffer_names))
    for name in ("buffer_rank", "buffer_name", "piece_tensor", "piece_buffer", "piece_offsets"):
        assert np.array_equal(getattr(other, name), getattr(canonical, name)), name


def test_derived_layouts_hash_and_group_like_rebuilt_ones():
    b = LayoutBuilder()
    for i in range(4):  # l0, l1 alike; l2 alike on ranks 0-3 but also whole on rank 5; l3 tp=2
        add_sharded_tensor(b, f"l{i}", (8, 4), "float32", [0, 1, 2, 3] if i != 3 else [0, 1], ["S(0)"])
    b.pieces("l2", b.buffers("l2.copy", [5], (8, 4), "float32"), [[0, 0]], [[8, 4]], [[0, 0]])
    layout = b.build()
    assert layout.tensor_layout_ids().tolist() == [0, 0, 1, 2]
    assert len(layout.fingerprint) == 32  # memoised: derived layouts inherit its rank digests
    for derive in (lambda x: x.without_ranks([5]), lambda x: x.without_ranks([1]).restrict_to_ranks([0, 2, 5]),
                   lambda x: x.without_ranks([0, 1, 2, 3, 5]), lambda x: x.without_ranks([]).without_ranks([4])):
        derived = derive(layout)
        fresh = _rebuilt(derived)
        assert derived.fingerprint == fresh.fingerprint
        assert derived.tensor_layout_ids().tolist() == fresh.tensor_layout_ids().tolist()
        assert derived.ranks == fresh.ranks and derived.nbytes == fresh.nbytes
    # Without rank 5, l2 joins l0 and l1.
    assert layout.without_ranks([5]).tensor_layout_ids().tolist() == [0, 0, 0, 1]


@st.composite
def repeated_layouts(draw):
    """Tensors drawn from a few shapes, dtypes and meshes, so that equal layouts are common."""
    b = LayoutBuilder()
    for i in range(draw(st.integers(1, 12))):
        shape = draw(st.sampled_from([(4,), (6, 4), (4, 6), (2, 3, 4)]))
        mesh = draw(st.sampled_from([[0], [0, 1], [1, 0], [0, 1, 2], [2, 3]]))
        dim = draw(st.integers(0, len(shape) - 1))
        add_sharded_tensor(b, f"t{i}", shape, draw(st.sampled_from(["float32", "bfloat16"])), mesh,
                           [draw(st.sampled_from(["R", f"S({dim})"]))])
    return b.build()


def _brute_force_layout_ids(layout):
    ids: dict[tuple, int] = {}
    out = []
    for i, t in enumerate(layout.tensors):
        rows = np.flatnonzero(layout.piece_tensor == i)
        key = (t.shape, t.dtype, repr([layout.piece_rank[rows].tolist(), layout.piece_offsets[rows].tolist(),
                                       layout.piece_lengths[rows].tolist()]))
        out.append(ids.setdefault(key, len(ids)))
    return out


@settings(max_examples=100, deadline=None)
@given(repeated_layouts(), st.booleans(), st.lists(st.integers(0, 3), max_size=2))
def test_tensor_layout_ids_are_exact_even_when_every_hash_collides(layout, collide, dropped):
    from unittest import mock

    from elastic_refit.layout import core

    def zeros(columns):  # every row hashes alike: every group is a collision to split
        return np.zeros(columns[0].shape[0], dtype=np.uint64)

    with mock.patch.object(core, "_row_hashes", zeros) if collide else contextlib.nullcontext():
        assert layout.tensor_layout_ids().tolist() == _brute_force_layout_ids(layout)
        derived = layout.without_ranks(dropped)  # hinted by the parent's ids
        assert derived.tensor_layout_ids().tolist() == _brute_force_layout_ids(derived)


def test_build_order_does_not_change_the_layout():
    """Canonical sorting: the same pieces declared in another order give the same arrays."""
    def build(order):
        bld = LayoutBuilder()
        for name in order:
            add_sharded_tensor(bld, name, (4, 4), "float32", [[3, 1], [0, 2]], ["S(0)", "S(1)"])
        return bld.build()

    x, y = build(["a", "b"]), build(["b", "a"])
    assert _pieces_as_rows(x) == _pieces_as_rows(y)
    assert np.array_equal(x.piece_rank, y.piece_rank)


# ---- spec files ----------------------------------------------------------------------------

GOOD = {
    "domain_size": 2,
    "tensors": [
        {"name": "w", "shape": [10, 6], "dtype": "bfloat16",
         "source": {"mesh": [[0, 1], [2, 3]], "placements": ["R", "S(0)"]},
         "destination": {"mesh": [4, 5, 6, 7], "placements": ["S(1)"]}},
        {"name": "b", "shape": [5],
         "source": {"mesh": [0], "placements": ["R"]},
         "destination": {"mesh": [[4, 5], [6, 7]], "placements": ["Replicate()", "Shard(0)"]}},
    ],
}


def _write(tmp_path, payload, name="spec.json"):
    path = tmp_path / name
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload, indent=1))
    return path


def test_spec_file_round_trip(tmp_path):
    spec = load_spec(_write(tmp_path, GOOD))
    assert spec.topology.domains == (0, 0, 1, 1, 2, 2, 3, 3)
    assert spec.source.tensor("w").dtype == "bfloat16" and spec.source.tensor("b").dtype == "float32"
    want_src, want_dst = LayoutBuilder(), LayoutBuilder()
    for t in GOOD["tensors"]:
        dtype = t.get("dtype", "float32")
        add_sharded_tensor(want_src, t["name"], t["shape"], dtype, t["source"]["mesh"], t["source"]["placements"])
        add_sharded_tensor(want_dst, t["name"], t["shape"], dtype, t["destination"]["mesh"],
                           t["destination"]["placements"])
    assert spec.source.fingerprint == want_src.build().fingerprint
    assert spec.destination.fingerprint == want_dst.build().fingerprint
    # Same content from a dict: parse_spec and load_spec agree.
    assert parse_spec(json.loads(json.dumps(GOOD))).destination.fingerprint == spec.destination.fingerprint
    with_domains = dict(GOOD, domains=[5, 5, 5, 5, 0, 1, 0, 1])
    del with_domains["domain_size"]
    assert parse_spec(with_domains).topology.domains == (5, 5, 5, 5, 0, 1, 0, 1)


def _bad(tmp_path, mutate):
    data = json.loads(json.dumps(GOOD))
    mutate(data)
    return _write(tmp_path, data)


@pytest.mark.parametrize(("mutate", "pattern"), [
    (lambda d: d.pop("tensors"), r"spec\.json: missing key 'tensors'"),
    (lambda d: d["tensors"][0].pop("shape"), r"spec\.json: tensor 'w': missing key 'shape'"),
    (lambda d: d["tensors"][1].pop("destination"), r"spec\.json: tensor 'b': missing key 'destination'"),
    (lambda d: d["tensors"][0]["source"].pop("mesh"), r"spec\.json: tensor 'w' source: missing key 'mesh'"),
    (lambda d: d["tensors"][0].pop("name"), r"spec\.json: tensors\[0\]: missing key 'name'"),
    (lambda d: d.update(tensors=[]), r"'tensors' must be a non-empty list"),
    (lambda d: d["tensors"][0]["source"].update(mesh=[[0, 1], [2]]),
     r"spec\.json: tensor 'w' source: mesh is ragged: \[\[0, 1\], \[2\]\]"),
    (lambda d: d["tensors"][0]["destination"].update(mesh=[4, 5, 5, 7]),
     r"spec\.json: tensor 'w' destination: mesh lists a rank twice: \[4, 5, 5, 7\]"),
    (lambda d: d["tensors"][0]["source"].update(placements=["R", "X(0)"]),
     r"spec\.json: tensor 'w' source: unknown placement 'X\(0\)'"),
    (lambda d: d["tensors"][0]["source"].update(placements="S(0)"),
     r"spec\.json: tensor 'w' source: 'placements' must be a list, got 'S\(0\)'"),
    (lambda d: d["tensors"][0].update(shape=10), r"spec\.json: tensor 'w': 'shape' must be a list of integers >= 0, got 10"),
    (lambda d: d["tensors"][0].update(shape=[10, "6"]), r"'shape' must be a list of integers >= 0, got \[10, '6'\]"),
    (lambda d: d["tensors"][0]["destination"].update(placements=["S(2)"]),
     r"tensor 'w' destination: placement S\(2\) on mesh axis 0 is out of range for shape \(10, 6\)"),
    (lambda d: d["tensors"][0].update(dtype="float7"), r"tensor 'w' source: unknown dtype 'float7'"),
    (lambda d: (d.pop("domain_size"), d.update(domains=[0, 0, 0, 0, 1, 1, 1])),
     r"spec\.json: 'domains' lists 7 ranks but the meshes use rank 7"),
    (lambda d: (d.pop("domain_size"), d.update(domains=[0, 0, 0, 0, 1, 1, 1, -1])),
     r"'domains' must be a list of integers >= 0"),
    (lambda d: d.update(domain_size=0), r"spec\.json: 'domain_size' must be an integer >= 1, got 0"),
    (lambda d: d.update(domain_size="8"), r"'domain_size' must be an integer >= 1, got '8'"),
])
def test_spec_errors_name_file_tensor_and_values(tmp_path, mutate, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_spec(_bad(tmp_path, mutate))


def test_spec_malformed_json_names_file_and_line(tmp_path):
    text = json.dumps(GOOD, indent=1).splitlines()
    text[5] = text[5] + " oops"
    path = _write(tmp_path, "\n".join(text), name="broken.json")
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: malformed JSON at line 6 column \d+"):
        load_spec(path)


def test_spec_not_an_object_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"list\.json: expected an object, got list"):
        load_spec(_write(tmp_path, [1, 2], name="list.json"))
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match=re.escape(f"spec file {str(missing)!r} does not exist")):
        load_spec(missing)


def test_public_api_is_reexported_lazily():
    import subprocess
    import sys

    code = ("import sys, elastic_refit; from elastic_refit import make_plan, LayoutBuilder; "
            "assert 'aetcd' not in sys.modules, 'planning must not load etcd'; "
            "from elastic_refit import ElasticRefit, TransportAborted, MembershipLost; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---- encoding (how a side publishes its layout) ---------------------------------------------
def test_an_encoded_layout_decodes_to_the_same_rows_and_fingerprint():
    from elastic_refit.layout import decode_layout, encode_layout

    layout = _two_tensor_layout()
    blob = encode_layout(layout)
    back = decode_layout(blob, layout.fingerprint)
    assert back.fingerprint == layout.fingerprint and back.tensors == layout.tensors
    assert back.buffer_names == layout.buffer_names
    for f in dataclasses.fields(Layout):
        if f.init and isinstance(getattr(layout, f.name), np.ndarray):
            assert np.array_equal(getattr(back, f.name), getattr(layout, f.name)), f.name


def test_a_corrupt_or_foreign_encoded_layout_is_refused():
    from elastic_refit.layout import decode_layout, encode_layout

    layout = _two_tensor_layout()
    blob = encode_layout(layout)
    with pytest.raises(ValueError, match=r"^not an encoded layout \(bad magic\)$"):
        decode_layout(b"JUNK" + blob[4:])
    with pytest.raises(ValueError, match=r"^corrupt encoded layout: "):
        decode_layout(blob[:-7])
    other = _two_tensor_layout(extra_row=1)
    with pytest.raises(ValueError, match=rf"^encoded layout has fingerprint {layout.fingerprint}, expected "
                                         rf"{other.fingerprint}$"):
        decode_layout(blob, other.fingerprint)


# ---- side files (one side described by itself) ----------------------------------------------
def test_a_side_file_describes_one_side_as_a_spec_file_would(tmp_path):
    from elastic_refit.layout import load_side, parse_side

    spec = parse_spec({"domain_size": 4, "tensors": [
        {"name": "w", "shape": [10, 6], "dtype": "bfloat16",
         "source": {"mesh": [[0, 1], [2, 3]], "placements": ["R", "S(0)"]},
         "destination": {"mesh": [4, 5], "placements": ["S(1)"]}},
        {"name": "up", "shape": [8, 3], "dtype": "float32",
         "source": {"mesh": [[0, 1], [2, 3]], "placements": ["_S(0, 2)", "S(0)"]},
         "destination": {"mesh": [4, 5], "placements": ["R"]}}]})
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"tensors": [
        {"name": "up", "shape": [8, 3], "dtype": "float32", "mesh": [[0, 1], [2, 3]], "placements": ["_S(0, 2)", "S(0)"]},
        {"name": "w", "shape": [10, 6], "dtype": "bfloat16", "mesh": [[0, 1], [2, 3]], "placements": ["R", "S(0)"]}]}))
    assert load_side(path).fingerprint == spec.source.fingerprint  # declared in another order, too
    serve = parse_side({"tensors": [{"name": "w", "shape": [10, 6], "dtype": "bfloat16", "mesh": [0, 1],
                                     "placements": ["S(1)"]},
                                    {"name": "up", "shape": [8, 3], "mesh": [0, 1], "placements": ["R"]}]})
    assert serve.ranks == (0, 1)  # its own side's ranks, from 0
    with pytest.raises(ValueError, match=r"^f.json: tensor 'w': missing key 'placements'$"):
        parse_side({"tensors": [{"name": "w", "shape": [8, 4], "mesh": [0, 1]}]}, "f.json")
    with pytest.raises(ValueError, match=r"is a directory$"):
        load_side(tmp_path)


# ---- bad spec input through the library: the exact one-line error of each ----------------
_T = {"name": "w", "shape": [10, 6], "dtype": "bfloat16", "source": {"mesh": [0, 1], "placements": ["S(0)"]},
      "destination": {"mesh": [2, 3], "placements": ["S(1)"]}}
_TOO_BIG = "more than the 4611686018427387904 (2**62) a layout can address"


@pytest.mark.parametrize("name, make, message", [
    ("shape overflowing int64 bytes", lambda tmp: parse_spec({"tensors": [dict(_T, shape=[2**40, 2**40])]}),
     f"spec: tensor 'w' source: [1099511627776, 1099511627776] bfloat16 is 2417851639229258349412352 bytes, {_TOO_BIG}"),
    ("a dim past int64", lambda tmp: parse_spec({"tensors": [dict(_T, shape=[2**63, 2])]}),
     f"spec: tensor 'w' source: [9223372036854775808, 2] bfloat16 is 36893488147419103232 bytes, {_TOO_BIG}"),
    ("rank id 1e9", lambda tmp: parse_spec({"tensors": [dict(_T, destination={"mesh": [10**9], "placements": ["R"]})]}),
     "spec: tensor 'w' destination: rank ids must be in [0, 1048576), got 1000000000"),
    ("rank id 1e9 as a float", lambda tmp: parse_spec({"tensors": [dict(_T, source={"mesh": [1e9], "placements": ["R"]})]}),
     "spec: tensor 'w' source: mesh must be nested lists of rank ids, got [1000000000.0]"),
    ("domain size 0", lambda tmp: parse_spec({"domain_size": 0, "tensors": [_T]}),
     "spec: 'domain_size' must be an integer >= 1, got 0"),
    ("deeply nested JSON", lambda tmp: load_spec(_written(tmp / "deep.json", "[" * 100_000 + "]" * 100_000)),
     "{tmp}/deep.json: JSON nested too deeply to read"),
    ("spec path a directory", lambda tmp: load_spec(tmp), "spec file '{tmp}' is a directory"),
])
def test_bad_spec_input_is_one_exact_line(tmp_path, name, make, message):
    with pytest.raises(ValueError) as info:
        make(tmp_path)
    assert str(info.value) == message.replace("{tmp}", str(tmp_path))


def _written(path, text: str):
    path.write_text(text)
    return path


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True), st.booleans())
def test_a_layout_without_ranks_fingerprints_as_the_same_layout_built_afresh(lost, hash_parent_first):
    """Derived layouts keep their parent's fingerprint blocks of the tensors and buffer names
    that lost nothing (``_select_ranks``); the result is the fresh layout's fingerprint."""
    from elastic_refit.layout import megatron_layout

    parent = megatron_layout("qwen3-30b-a3b", "tp=2,pp=2,dp=2")
    if hash_parent_first:
        parent.fingerprint  # noqa: B018 - its blocks carry over
    derived = parent.without_ranks(lost)
    fields = {f.name: getattr(derived, f.name) for f in dataclasses.fields(Layout) if f.init}
    assert derived.fingerprint == Layout(**fields).fingerprint
    again = derived.without_ranks([max(lost) ^ 1])  # and from a derived one
    fields = {f.name: getattr(again, f.name) for f in dataclasses.fields(Layout) if f.init}
    assert again.fingerprint == Layout(**fields).fingerprint
