"""Replica regions of source layouts (pure, against small topology tables), the digests a
rank takes of them, and the disagreement the coordinator refuses a version for."""

from __future__ import annotations

import pytest
import torch

from elastic_refit.layout import Box, LayoutBuilder, parse_spec
from elastic_refit.runtime.replicas import (
    ReplicaRegion,
    region_digests,
    replica_disagreement,
    replica_regions,
)
from elastic_refit.testing.pattern import allocate, fill_pieces


def source(mesh, placements, shape=(8, 4)):
    spec = parse_spec({"domains": [0] * 8, "tensors": [
        {"name": "w", "shape": list(shape), "dtype": "float32",
         "source": {"mesh": mesh, "placements": placements},
         "destination": {"mesh": [7], "placements": ["R"]}}]})
    return spec.source


@pytest.mark.parametrize("mesh, placements, expected", [
    ([0], ["R"], []),  # one rank: nothing to compare
    ([0, 1], ["S(0)"], []),  # shards: disjoint
    ([0, 1], ["R"], [("[0:8, 0:4]", (0, 1))]),  # data-parallel replicas
    ([0, 1, 2], ["R"], [("[0:8, 0:4]", (0, 1, 2))]),
    ([[0, 1], [2, 3]], ["R", "S(0)"], [("[0:4, 0:4]", (0, 2)), ("[4:8, 0:4]", (1, 3))]),  # dp x tp
    ([[0, 1], [2, 3]], ["S(1)", "R"], [("[0:8, 0:2]", (0, 1)), ("[0:8, 2:4]", (2, 3))]),
])
def test_replica_regions(mesh, placements, expected):
    regions = replica_regions(source(mesh, placements))
    assert [(str(r.box), r.ranks) for r in regions] == expected
    assert [r.index for r in regions] == list(range(len(regions)))


def test_replicas_sharded_differently_compare_where_they_overlap():
    # rank 0 holds all of w; ranks 1 and 2 hold its halves (a replica sharded otherwise)
    b = LayoutBuilder()
    t = b.tensor("w", (8, 4), "float32")
    whole = b.buffers("w", [0], (8, 4), "float32")
    b.pieces(t, whole, [[0, 0]], [[8, 4]], [[0, 0]])
    halves = b.buffers("w", [1, 2], (4, 4), "float32")
    b.pieces(t, halves, [[0, 0], [4, 0]], [[4, 4], [4, 4]], [[0, 0], [0, 0]])
    regions = replica_regions(b.build())
    assert [(str(r.box), r.ranks) for r in regions] == [("[0:4, 0:4]", (0, 1)), ("[4:8, 0:4]", (0, 2))]


def test_region_digests_agree_on_equal_replicas_and_tell_a_changed_one():
    layout = source([[0, 1], [2, 3]], ["R", "S(0)"])
    regions = replica_regions(layout)
    tensors = {rank: allocate(layout, rank, fill=0) for rank in range(4)}
    for rank in range(4):
        fill_pieces(layout, rank, tensors[rank], seed=7)
    digests = {rank: region_digests(layout, rank, tensors[rank], regions) for rank in range(4)}
    assert set(digests[0]) == {0} and set(digests[1]) == {1}  # each rank digests what it holds
    names = {0: "t0", 1: "t1", 2: "t2", 3: "t3"}
    assert replica_disagreement(regions, digests, names) is None
    before = float(tensors[3]["w"][1, 2])
    tensors[3]["w"][1, 2] = before + 0.5 if abs(before) < 1e6 else 0.5  # an unreduced gradient on one replica
    assert float(tensors[3]["w"][1, 2]) != before
    digests[3] = region_digests(layout, 3, tensors[3], regions)
    assert replica_disagreement(regions, digests, names) == (
        "source replicas disagree on tensor 'w' region [4:8, 0:4]: rank 1 (t1) and rank 3 (t3) hold different values")
    del digests[1]  # a replica that did not publish is not compared
    assert replica_disagreement(regions, digests, names) is None


def test_replica_region_rejects_fewer_than_two_ranks():
    with pytest.raises(ValueError, match="two or more distinct sorted ranks"):
        ReplicaRegion(0, "w", Box((0,), (4,)), (3,))
    with pytest.raises(ValueError, match="two or more distinct sorted ranks"):
        ReplicaRegion(0, "w", Box((0,), (4,)), (2, 1))


def test_region_digests_of_a_rank_without_regions_is_empty():
    layout = source([0, 1], ["S(0)"])
    assert region_digests(layout, 0, {"w": torch.zeros(4, 4)}, replica_regions(layout)) == {}


def test_a_strided_region_inside_a_wider_buffer_is_compared_element_for_element():
    # rank 0 holds all of w; ranks 1 and 2 its column halves: rank 0's regions are strided
    # views (rows of 512 bytes), which the compiled digest reads in place
    b = LayoutBuilder()
    t = b.tensor("w", (8, 256), "float32")
    whole = b.buffers("w", [0], (8, 256), "float32")
    b.pieces(t, whole, [[0, 0]], [[8, 256]], [[0, 0]])
    halves = b.buffers("w", [1, 2], (8, 128), "float32")
    b.pieces(t, halves, [[0, 0], [0, 128]], [[8, 128], [8, 128]], [[0, 0], [0, 0]])
    layout = b.build()
    regions = replica_regions(layout)
    assert [(str(r.box), r.ranks) for r in regions] == [("[0:8, 0:128]", (0, 1)), ("[0:8, 128:256]", (0, 2))]
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(5))
    tensors = {0: {"w": w.clone()}, 1: {"w": w[:, :128].clone()}, 2: {"w": w[:, 128:].clone()}}
    digests = {rank: region_digests(layout, rank, tensors[rank], regions) for rank in range(3)}
    names = {0: "t0", 1: "t1", 2: "t2"}
    assert replica_disagreement(regions, digests, names) is None
    for row, col in ((0, 0), (7, 127), (3, 128), (7, 255)):
        changed = {"w": tensors[0]["w"].clone()}
        changed["w"][row, col] += 1.0
        half = "[0:8, 0:128]: rank 0 (t0) and rank 1 (t1)" if col < 128 else "[0:8, 128:256]: rank 0 (t0) and rank 2 (t2)"
        assert replica_disagreement(regions, {**digests, 0: region_digests(layout, 0, changed, regions)}, names) == (
            f"source replicas disagree on tensor 'w' region {half} hold different values"), (row, col)
