"""Buffer checks the runtime applies to what users hand it: overlap in memory, digests."""

from __future__ import annotations

import torch

from elastic_refit.transport.buffers import buffers_digest, overlapping


def test_overlapping_finds_views_that_share_bytes_and_passes_disjoint_views():
    base = torch.zeros(4, 8)
    assert overlapping({"a": base[0], "b": base[1], "c": base[2:]}) is None  # one storage, disjoint bytes
    assert overlapping({"w": base, "x": torch.zeros(3)}) is None
    assert overlapping({"z": base[1:3], "a": base[2]}) == ("a", "z")
    flat = base.view(-1)
    assert overlapping({"p": flat[:9], "q": flat[8:16]}) == ("p", "q")  # one element in common
    assert overlapping({"p": flat[:8], "q": flat[8:16]}) is None  # adjacent, not overlapping
    assert overlapping({"e": base[0, :0], "f": base[0]}) is None  # an empty tensor holds no bytes


def test_buffers_digest_depends_on_every_byte_and_name_but_not_on_order():
    a = {"w": torch.arange(12, dtype=torch.float32), "b": torch.ones(3)}
    same = {"b": torch.ones(3), "w": torch.arange(12, dtype=torch.float32)}
    assert buffers_digest(a) == buffers_digest(same)
    changed = {"w": a["w"].clone(), "b": a["b"]}
    changed["w"][7] += 1
    assert buffers_digest(changed) != buffers_digest(a)
    assert buffers_digest({"v": a["w"], "b": a["b"]}) != buffers_digest(a)
