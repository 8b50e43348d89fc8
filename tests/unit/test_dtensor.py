"""DTensor interop: strided shards, sub-mesh lifting, plain tensors, rank renaming, local shards.

The reference is always torch itself: ``distribute_tensor`` (each fake-backend rank splits
the global tensor locally, ``src_data_rank=None``) and, in a real 4-process gloo world,
FSDP2 + TP (``fully_shard`` over ``parallelize_module``) and HSDP, whose ``full_tensor()``
must equal every rank's local shard at our pieces' boxes.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import socket

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_refit.layout import LayoutBuilder, parse_spec
from elastic_refit.layout.dtensor import (
    Replicate,
    Shard,
    StridedShard,
    add_sharded_tensor,
    from_dtensors,
    local_shards,
    parse_placement,
    shard_boxes,
    shard_intervals,
    shard_pieces,
)


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int):
    """One rank of a ``world_size`` world in this process (the fake backend runs no
    collectives; DeviceMesh and DTensor are the real classes)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():  # pragma: no cover - another test leaked a group
        dist.destroy_process_group()
    store = FakeStore()  # keep a Python reference for the group's lifetime (DESIGN pitfall)
    dist.init_process_group("fake", store=store, rank=rank, world_size=world_size)
    try:
        yield store
    finally:
        dist.destroy_process_group()


def _torch_placement(p):
    from torch.distributed.tensor.placement_types import Replicate as TR
    from torch.distributed.tensor.placement_types import Shard as TS
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, Replicate):
        return TR()
    if isinstance(p, StridedShard):
        return _StridedShard(p.dim, split_factor=p.split_factor)
    return TS(p.dim)


def _pieces_by_rank(layout) -> dict[int, list]:
    by_rank: dict[int, list] = {}
    for p in layout.pieces():
        by_rank.setdefault(p.rank, []).append(p)
    return by_rank


def _check_pieces_cover(layout, rank: int, buffer: str, local: np.ndarray, glob: np.ndarray, by_rank=None):
    """Our pieces of ``rank`` reproduce ``local`` from ``glob`` and cover it exactly once."""
    (buf,) = [b for b in layout.buffers(rank) if b.name == buffer] or [None]
    assert buf is not None and buf.shape == tuple(local.shape), (rank, buf, local.shape)
    counts = np.zeros(local.shape, dtype=np.int64)
    for p in (by_rank if by_rank is not None else _pieces_by_rank(layout)).get(rank, []):
        if p.buffer != buffer:
            continue
        lsl = tuple(slice(o, o + n) for o, n in zip(p.local_box.offsets, p.local_box.lengths, strict=True))
        gsl = tuple(slice(o, o + n) for o, n in zip(p.box.offsets, p.box.lengths, strict=True))
        np.testing.assert_array_equal(local[lsl], glob[gsl], err_msg=f"rank {rank}: {p}")
        counts[lsl] += 1
    assert (counts == 1).all(), (rank, counts)


# ---- parity with torch: Shard / Replicate / _StridedShard in any order -----------------------


@st.composite
def strided_cases(draw):
    """1-3 mesh axes of size 1-4, 1-3 dims of size 0-13 (uneven, often smaller than the mesh),
    placements that often put several shards (strided or not) on one dim, a permuted mesh."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(0, 13)) for _ in range(ndim))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    dims = st.integers(0, ndim - 1)
    placements = [
        draw(st.one_of(st.just(Replicate()), dims.map(Shard),
                       st.builds(StridedShard, dims, st.integers(1, 4))))
        for _ in mesh_shape
    ]
    perm = np.array(draw(st.permutations(range(int(np.prod(mesh_shape))))), dtype=np.int64)
    return shape, mesh_shape, placements, perm.reshape(mesh_shape)


@settings(max_examples=100, deadline=None)
@given(strided_cases())
def test_pieces_reproduce_torch_local_shard_of_every_rank(case):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, _, placements, mesh = case
    builder = LayoutBuilder()
    add_sharded_tensor(builder, "t", shape, "float64", mesh, placements)
    layout = builder.build()
    by_rank = _pieces_by_rank(layout)
    glob = torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape)
    theirs = [_torch_placement(p) for p in placements]
    for rank in range(mesh.size):
        with fake_rank(rank, mesh.size):
            # _init_backend=False: no per-axis groups (nothing here communicates; creating
            # them is most of the cost); the rank's coordinate still comes from the world.
            device_mesh = DeviceMesh("cpu", mesh.tolist(), _init_backend=False)
            local = distribute_tensor(glob, device_mesh, theirs, src_data_rank=None).to_local()
            local_shape, global_offset = compute_local_shape_and_global_offset(shape, device_mesh, theirs)
        assert tuple(local.shape) == tuple(local_shape)
        _check_pieces_cover(layout, rank, "t", local.numpy(), glob.numpy(), by_rank)
        if local.numel():  # torch's offset is where local element 0 lives (the first offset of a strided shard)
            (first,) = [p for p in by_rank[rank] if not any(p.local_box.offsets)]
            assert first.box.offsets == tuple(global_offset), (rank, first, global_offset)


def test_strided_shard_matches_torch_docstring_examples():
    # _StridedShard's docstring: [8, 8] on (dp=2, tp=2) with (_S(0, 2), S(0)): rank (0, 1)
    # holds rows 4-5, rank (1, 0) rows 2-3: one box each, in "right-to-left" order.
    sp = shard_pieces((8, 8), (2, 2), [StridedShard(0, 2), Shard(0)])
    assert sp.position.tolist() == [0, 1, 2, 3]
    assert sp.offsets[:, 0].tolist() == [0, 4, 2, 6] and sp.lengths[:, 0].tolist() == [2, 2, 2, 2]
    # _to_replicate_tensor's docstring: 9 elements, _S(0, 2) over 4 ranks:
    # [0, 1, 5], [2, 3, 6], [4, 7], [8]: several boxes in one local buffer.
    ((g, n, s),) = shard_intervals((9,), (4,), [StridedShard(0, 2)])
    rows = [[(int(a), int(b), int(c)) for a, b, c in zip(g[i], n[i], s[i], strict=True) if b]
            for i in range(4)]
    assert rows == [[(0, 2, 0), (5, 1, 2)], [(2, 2, 0), (6, 1, 2)], [(4, 1, 0), (7, 1, 1)], [(8, 1, 0)]]


def test_strided_shard_with_split_factor_one_is_shard():
    def build(placements):
        b = LayoutBuilder()
        add_sharded_tensor(b, "w", (11, 5), "float32", [[0, 1, 2], [3, 4, 5]], placements)
        return b.build()

    assert build(["_S(0, 1)", "S(1)"]).fingerprint == build(["S(0)", "S(1)"]).fingerprint
    # a size-1 mesh axis: the split_factor parts are all kept, adjacent, and joined
    def build_2x1(placements):
        b = LayoutBuilder()
        add_sharded_tensor(b, "w", (11, 5), "float32", [[0], [1]], placements)
        return b.build()

    assert build_2x1(["S(0)", "_S(0, 3)"]).fingerprint == build_2x1(["S(0)", "R"]).fingerprint
    assert build_2x1(["S(0)", "_S(0, 3)"]).num_pieces == 2


def test_parse_placement_strided_spellings_and_errors():
    for text in ("_S(0, 2)", "StridedShard(0, 2)", "_StridedShard(0, 2)", " _StridedShard(dim=0, sf=2) ",
                 "StridedShard(dim=0, split_factor=2)"):
        assert parse_placement(text) == StridedShard(0, 2), text
    assert str(StridedShard(1, 4)) == "_S(1, 4)" and parse_placement(str(StridedShard(1, 4))) == StridedShard(1, 4)
    # torch's own str() and repr() parse back
    from torch.distributed.tensor.placement_types import _StridedShard

    assert parse_placement(str(_StridedShard(2, split_factor=3))) == StridedShard(2, 3)
    assert parse_placement(repr(_StridedShard(2, split_factor=3))) == StridedShard(2, 3)
    with pytest.raises(ValueError, match=re.escape(
            "unknown placement '_S(0)': use \"R\" or \"S(dim)\" (or \"_S(dim, split_factor)\" for a strided shard)")):
        parse_placement("_S(0)")
    with pytest.raises(ValueError, match="StridedShard split_factor must be an integer >= 1, got 0"):
        StridedShard(0, 0)
    with pytest.raises(ValueError, match="StridedShard dim must be an integer >= 0, got -1"):
        StridedShard(-1, 2)
    with pytest.raises(ValueError, match=re.escape(
            "shard_boxes gives one box per mesh position, but strided placement _S(0, 2) splits a "
            "shard into several boxes: use shard_pieces (or shard_intervals) instead")):
        shard_boxes((4,), (2,), [StridedShard(0, 2)])
    with pytest.raises(ValueError, match=re.escape("placement _S(1, 2) on mesh axis 0 is out of range for shape (4,)")):
        shard_pieces((4,), (2,), [StridedShard(1, 2)])


def test_spec_files_accept_strided_placements():
    spec = parse_spec({"domain_size": 4, "tensors": [
        {"name": "w", "shape": [8, 3], "dtype": "float32",
         "source": {"mesh": [[0, 1], [2, 3]], "placements": ["_S(0, 2)", "S(0)"]},
         "destination": {"mesh": [4, 5], "placements": ["R"]}}]})
    rows = sorted((p.rank, p.box.offsets[0]) for p in spec.source.pieces())
    assert rows == [(0, 0), (1, 4), (2, 2), (3, 6)]


# ---- sub-mesh lifting: every rank builds the same layout ------------------------------------


def _arange(*shape: int) -> torch.Tensor:
    return torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)


def _lifting_world():
    """On this rank of a (a=2, b=2, c=2) world: DTensors on the root, on sub-meshes (FSDP2 +
    TP's strided placements on one of them) and on a flattened sub-mesh, plus a plain tensor.
    Returns (layout, {name: (local shard, full tensor)}, what torch's .mesh shows this rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import Replicate as TR
    from torch.distributed.tensor.placement_types import Shard as TS
    from torch.distributed.tensor.placement_types import _StridedShard

    root = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
    flat = root["b", "c"]._flatten("bc")
    specs = {  # name: (full tensor, mesh, placements); src_data_rank=None: each rank splits locally
        "root": (_arange(9, 6), root, [_StridedShard(0, split_factor=2), TS(0), TS(1)]),
        "on_b": (_arange(5, 3), root["b"], [TS(0)]),
        "on_ac": (_arange(7, 4), root["a", "c"], [TS(1), TS(0)]),
        "on_bc": (_arange(10), flat, [TS(0)]),
        "on_bc_fsdp_tp": (_arange(9, 4), root["b", "c"], [_StridedShard(0, split_factor=2), TS(0)]),
        "on_b_repl": (_arange(2, 2), root["b"], [TR()]),
    }
    tensors = {name: distribute_tensor(full, mesh, placements, src_data_rank=None)
               for name, (full, mesh, placements) in specs.items()}
    tensors["plain"] = _arange(3)
    layout = from_dtensors(tensors).build()
    data = {name: (t.to_local() if name != "plain" else t, specs[name][0] if name != "plain" else t)
            for name, t in tensors.items()}
    return layout, data, {"b": root["b"].mesh.tolist(), "bc": flat.mesh.tolist()}


def test_sub_meshes_are_lifted_to_the_same_layout_on_every_rank():
    root = np.arange(8).reshape(2, 2, 2)
    want = LayoutBuilder()
    add_sharded_tensor(want, "root", (9, 6), "float32", root[None], ["R", "_S(0, 2)", "S(0)", "S(1)"])
    # copies of root["b"] are the (a, c) pairs; copies of root["a", "c"] the b values, ...
    add_sharded_tensor(want, "on_b", (5, 3), "float32", root.transpose(0, 2, 1).reshape(4, 2), ["R", "S(0)"])
    add_sharded_tensor(want, "on_ac", (7, 4), "float32", root.transpose(1, 0, 2), ["R", "S(1)", "S(0)"])
    add_sharded_tensor(want, "on_bc", (10,), "float32", root.reshape(2, 4), ["R", "S(0)"])
    add_sharded_tensor(want, "on_bc_fsdp_tp", (9, 4), "float32", root, ["R", "_S(0, 2)", "S(0)"])
    add_sharded_tensor(want, "on_b_repl", (2, 2), "float32", root.reshape(1, 8), ["R", "R"])
    add_sharded_tensor(want, "plain", (3,), "float32", list(range(8)), ["R"])
    want = want.build()
    fingerprints = set()
    for rank in range(8):
        with fake_rank(rank, 8):
            layout, data, views = _lifting_world()
        fingerprints.add(layout.fingerprint)
        # what torch shows each rank is only the copy that holds it
        assert views["b"] == [rank - (rank & 2), rank | 2] and rank in views["bc"]
        by_rank = _pieces_by_rank(layout)
        for name, (local, full) in data.items():
            _check_pieces_cover(layout, rank, name, local.numpy(), full.numpy(), by_rank)
    assert fingerprints == {want.fingerprint}


@st.composite
def sub_mesh_cases(draw):
    """A root mesh of 2-3 named axes (sizes 1-3), a sub-mesh on a non-empty subset of them
    (root order), placements on the sub-mesh (strided too) and a tensor shape."""
    names = ("a", "b", "c")[: draw(st.integers(2, 3))]
    root_shape = tuple(draw(st.integers(1, 3)) for _ in names)
    chosen = tuple(n for n in names if draw(st.booleans())) or (draw(st.sampled_from(names)),)
    ndim = draw(st.integers(1, 2))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    dims = st.integers(0, ndim - 1)
    placements = [draw(st.one_of(st.just(Replicate()), dims.map(Shard),
                                 st.builds(StridedShard, dims, st.integers(1, 3)))) for _ in chosen]
    return names, root_shape, chosen, shape, placements


@settings(max_examples=30, deadline=None)
@given(sub_mesh_cases())
def test_sub_mesh_lifting_matches_torch_on_random_meshes(case):
    """Every rank of the root sees only its own copy of the sub-mesh, yet builds the same
    layout (fingerprint), and that layout reproduces torch's local shard on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    names, root_shape, chosen, shape, placements = case
    world = int(np.prod(root_shape))
    full = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
    fingerprints = set()
    for rank in range(world):
        with fake_rank(rank, world):
            root = init_device_mesh("cpu", root_shape, mesh_dim_names=names)
            sub = root[chosen] if len(chosen) > 1 else root[chosen[0]]
            dt = distribute_tensor(full, sub, [_torch_placement(p) for p in placements], src_data_rank=None)
            layout = from_dtensors({"w": dt}).build()
            fingerprints.add(layout.fingerprint)
            _check_pieces_cover(layout, rank, "w", dt.to_local().numpy(), full.numpy())
    assert len(fingerprints) == 1, fingerprints


# ---- plain tensors, rank renaming, names, Partial ---------------------------------------------


def _dtensor_2x2(shape=(6, 4), placements=("R", "S(0)")):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import distribute_tensor

    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    return distribute_tensor(torch.zeros(shape), mesh, [_torch_placement(parse_placement(p)) for p in placements],
                             src_data_rank=None)


def _rows(layout):
    return sorted((p.tensor, p.rank, p.buffer, p.box, p.local_box) for p in layout.pieces())


def test_partial_and_unknown_placements_are_rejected_with_one_message():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Partial
    from torch.distributed.tensor.placement_types import Replicate as TR

    with fake_rank(0, 4):
        mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
        pending = DTensor.from_local(torch.zeros(2, 3), mesh, [TR(), Partial("max")], run_check=False,
                                     shape=torch.Size([2, 3]), stride=(3, 1))
        with pytest.raises(ValueError) as err:
            from_dtensors({"layers.0.grad": pending})
        assert str(err.value) == (
            "tensor 'layers.0.grad': placement P(max) is not supported (only Shard and Replicate); "
            "_StridedShard counts as Shard; a Partial DTensor holds unreduced values: "
            "redistribute() it to Shard or Replicate first")
        with pytest.raises(ValueError, match=r"^'x' is a str, not a tensor$"):
            from_dtensors({"x": "weights"})


def test_plain_tensors_are_replicated_over_the_given_ranks():
    with fake_rank(0, 4):
        dt = _dtensor_2x2()
        got = from_dtensors({"w": dt, "norm": torch.ones(5)}, plain_ranks=[1, 3]).build()
        default = from_dtensors([("w", dt), ("norm", torch.ones(5))]).build()  # all ranks of w's mesh
    want = LayoutBuilder()
    add_sharded_tensor(want, "w", (6, 4), "float32", [[[0, 1], [2, 3]]], ["R", "R", "S(0)"])
    add_sharded_tensor(want, "norm", (5,), "float32", [1, 3], ["R"])
    assert got.fingerprint == want.build().fingerprint
    assert sorted(p.rank for p in default.pieces("norm")) == [0, 1, 2, 3]
    only = from_dtensors({"bias": torch.zeros(2)}, plain_ranks=[2, 0]).build()
    assert [(p.rank, p.box.lengths) for p in only.pieces()] == [(0, (2,)), (2, (2,))]
    with pytest.raises(ValueError) as err:
        from_dtensors({"bias": torch.zeros(2)})
    assert str(err.value) == (
        "'bias' is a Tensor, not a DTensor, and no DTensor mesh says which ranks hold it: "
        "pass plain_ranks=[...] (the torch ranks that replicate it)")
    with pytest.raises(ValueError, match=re.escape("plain_ranks must be a non-empty list of torch ranks, got []")):
        from_dtensors({"bias": torch.zeros(2)}, plain_ranks=[])


def test_rank_map_and_rank_offset_rename_meshes_and_plain_ranks():
    with fake_rank(0, 4):
        dt = _dtensor_2x2((5, 3), ("S(1)", "_S(0, 2)"))
        named = {"w": dt, "b": torch.zeros(3)}
        shifted = from_dtensors(named, rank_offset=4).build()
        mapped = from_dtensors(named, rank_map={0: 7, 1: 5, 2: 6, 3: 4}).build()
        with pytest.raises(ValueError, match=re.escape("tensor 'w': rank_map has no entry for torch rank(s) [2, 3]")):
            from_dtensors(named, rank_map={0: 0, 1: 1})
        with pytest.raises(ValueError, match=re.escape("give rank_map or rank_offset, not both (rank_offset=1)")):
            from_dtensors(named, rank_map={0: 0}, rank_offset=1)
        with pytest.raises(ValueError, match=re.escape("rank_map sends torch ranks [1, 2] to the same layout rank 9")):
            from_dtensors(named, rank_map={0: 0, 1: 9, 2: 9, 3: 3})
        with pytest.raises(ValueError, match=re.escape("tensor 'w': mesh ranks must be >= 0: [[[-1, 0], [1, 2]]]")):
            from_dtensors(named, rank_offset=-1)
    for mesh, got in (([[4, 5], [6, 7]], shifted), ([[7, 5], [6, 4]], mapped)):
        want = LayoutBuilder()
        add_sharded_tensor(want, "w", (5, 3), "float32", [mesh], ["R", "S(1)", "_S(0, 2)"])
        add_sharded_tensor(want, "b", (3,), "float32", sorted(np.ravel(mesh).tolist()), ["R"])
        assert got.fingerprint == want.build().fingerprint


def test_modules_and_names_map_parameters_to_logical_tensors():
    from torch import nn

    with fake_rank(0, 4):
        model = nn.Module()
        model.proj = nn.Module()
        model.proj.weight = nn.Parameter(_dtensor_2x2((6, 4), ("R", "S(0)")))
        model.scale = nn.Parameter(torch.ones(4))
        renamed = {"proj.weight": "model.layers.0.mlp.weight", "scale": "model.norm.weight"}
        by_map = from_dtensors(model, names=renamed).build()
        by_call = from_dtensors(model, names=lambda n: renamed[n]).build()
        plain = from_dtensors(model).build()
        with pytest.raises(ValueError, match=re.escape(
                "names has no entry for parameter 'scale' (use a callable for partial renames)")):
            from_dtensors(model, names={"proj.weight": "w"})
        with pytest.raises(ValueError, match=re.escape(
                "parameters 'scale' and 'proj.weight' both map to logical tensor 'w'")):
            from_dtensors(model, names=lambda n: "w")
    assert by_map.fingerprint == by_call.fingerprint
    assert {(p.tensor, p.buffer) for p in by_map.pieces()} == {
        ("model.layers.0.mlp.weight", "proj.weight"), ("model.norm.weight", "scale")}
    assert {p.tensor for p in plain.pieces()} == {"proj.weight", "scale"}
    assert sorted(p.rank for p in by_map.pieces("model.norm.weight")) == [0, 1, 2, 3]


def test_local_shards_are_detached_views_of_the_parameters():
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Shard as TS

    with fake_rank(1, 4):
        model = nn.Module()
        model.w = nn.Parameter(_dtensor_2x2((6, 4), ("R", "S(0)")))  # rank 1: rows 3-5
        model.b = nn.Parameter(torch.zeros(3))
        shards = local_shards(model)
        assert set(shards) == {"w", "b"} and shards["w"].shape == (3, 4)
        assert not shards["w"].requires_grad and not shards["b"].requires_grad
        shards["w"].fill_(2.0)  # the refit's receive writes in place
        shards["b"][1] = 5.0
        assert (model.w.to_local() == 2.0).all() and model.b.tolist() == [0.0, 5.0, 0.0]
        assert shards["w"].untyped_storage().data_ptr() == model.w.to_local().untyped_storage().data_ptr()
        assert local_shards([("b", model.b)])["b"].data_ptr() == model.b.data_ptr()
        mesh = DeviceMesh("cpu", [0, 1, 2, 3])
        transposed = DTensor.from_local(torch.zeros(3, 2).t(), mesh, [TS(1)], run_check=False)
        with pytest.raises(ValueError, match=re.escape(
                "parameter 'wt': local tensor of shape (2, 3) with strides (1, 2) is not contiguous")):
            local_shards({"wt": transposed})
        with pytest.raises(ValueError, match=re.escape("parameter 'p': local tensor of shape (4, 2)")):
            local_shards({"p": torch.zeros(2, 4).t()})


# ---- real FSDP2 + TP and HSDP in a 4-process gloo world --------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_model(model, rank: int) -> tuple[str, dict[str, str]]:
    """On one rank: our layout of ``model`` reproduces every local shard from the full tensor,
    covers every element, and writes into ``local_shards`` reach the parameters."""
    layout = from_dtensors(model).build()
    shards = local_shards(model)
    by_rank = _pieces_by_rank(layout)
    placements = {}
    for name, param in model.named_parameters():
        full = param.full_tensor().detach().numpy()  # a collective: every rank calls it
        _check_pieces_cover(layout, rank, name, shards[name].numpy(), full, by_rank)
        counts = np.zeros(full.shape, dtype=np.int64)  # the whole side holds every element
        for p in layout.pieces(name):
            counts[tuple(slice(o, o + n) for o, n in zip(p.box.offsets, p.box.lengths, strict=True))] += 1
        assert (counts >= 1).all(), name
        shards[name].add_(1.0)  # what a refit's receive does, in place
        np.testing.assert_array_equal(param.full_tensor().detach().numpy(), full + 1.0, err_msg=name)
        placements[name] = str(tuple(str(p) for p in param.placements))
    return layout.fingerprint, placements


def _fsdp_worker(rank: int, port: int, out_dir: str) -> None:
    import os

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # four ranks share this machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    try:
        torch.manual_seed(0)  # same initial weights on every rank: replicas agree

        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.up = nn.Linear(6, 10)  # colwise: weight and bias rows split by tp, then dp
                self.down = nn.Linear(10, 5)  # rowwise: weight columns by tp, rows by dp
                self.norm = nn.Parameter(torch.randn(7))  # not TP'd: FSDP2 puts it on the dp sub-mesh

        # torchtitan's recipe: TP on the "tp" axis, then FSDP2 over "dp".
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = Block()
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        # HSDP: replicate over "rep", shard over "shard"; (Replicate(), Shard(0)) placements.
        hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
        hsdp = nn.Sequential(nn.Linear(5, 9), nn.Linear(9, 3))
        fully_shard(hsdp, mesh=hsdp_mesh)
        result = {"fsdp_tp": _check_model(model, rank), "hsdp": _check_model(hsdp, rank)}
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _start_method() -> str:
    """``fork`` when this process looks fork-safe (children then skip re-importing torch,
    ~4 s of CPU each), else ``forkserver`` (a fresh, single-threaded parent). gRPC channels
    (etcd clients of other tests) and foreign threads do not survive fork."""
    import sys
    import threading

    import torch.distributed as dist

    if "grpc" in sys.modules or threading.active_count() > 1 or dist.is_initialized():
        return "forkserver"
    return "fork"


def test_fsdp2_tp_and_hsdp_layouts_agree_on_every_rank(tmp_path):
    import multiprocessing
    import time

    import torch.multiprocessing as mp

    # Imported here, not in each child: parallelize_module pulls in torch._dynamo.
    preload = ["torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor.parallel", __name__]
    for module in preload[:-1]:
        __import__(module)
    method = _start_method()
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(preload)
    context = mp.start_processes(_fsdp_worker, args=(_free_port(), str(tmp_path)), nprocs=4, join=False,
                                 start_method=method)
    deadline = time.monotonic() + 180
    while not context.join(timeout=1):  # raises with the child's traceback if one fails
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("FSDP2 workers did not finish within 180 s")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for model in ("fsdp_tp", "hsdp"):
        assert len({r[model][0] for r in results}) == 1, [r[model][0] for r in results]
    placements = results[0]["fsdp_tp"][1]
    # the cases this test exists for: strided shards on TP-colwise weights, a dp sub-mesh norm
    assert placements["up.weight"] == "('_S(0, 2)', 'S(0)')"
    assert placements["down.weight"] == "('S(0)', 'S(1)')"
    assert placements["norm"] == "('S(0)',)"
    assert results[0]["hsdp"][1]["0.weight"] == "('R', 'S(0)')"


def test_intervals_are_in_local_order_and_tile_each_local_extent():
    """Independent of torch: per dim, a position's non-empty intervals tile [0, local extent)."""
    for shape, mesh_shape, placements in itertools.product(
            [(13,), (7,)], [(4,), (2, 3)], [[StridedShard(0, 3)], [Shard(0)]]):
        placements = (placements * len(mesh_shape))[: len(mesh_shape)]
        ((g, n, s),) = shard_intervals(shape, mesh_shape, placements)
        for row in range(g.shape[0]):
            keep = n[row] > 0
            assert (np.cumsum(np.r_[0, n[row][keep]])[:-1] == s[row][keep]).all()


def test_the_layout_layer_imports_without_torch():
    import subprocess
    import sys

    code = ("import sys, elastic_refit.layout.dtensor as d; "
            "d.shard_pieces((8,), (2, 2), [d.StridedShard(0, 2), d.Shard(0)]); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
