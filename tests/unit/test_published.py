"""A trainer's published versions: the caller's buffers of its latest publish, known weakly
(an executor is bound to them ahead of the next epoch's first refit, never kept alive for it)."""

from __future__ import annotations

import gc

import torch

from elastic_refit.runtime.outcomes import Outcomes
from elastic_refit.runtime.published import Published, PublishedVersions


def _published(tensors: dict, copy_bytes: int = 0) -> Published:
    return Published(tensors, "layout", {name: 0 for name in tensors}, copy_bytes=copy_bytes)


def test_the_last_uncopied_publish_s_buffers_while_they_live():
    versions = PublishedVersions(budget_bytes=1 << 20, outcomes=Outcomes("t0"))
    assert versions.last_buffers() == {}
    w, b = torch.zeros(4), torch.ones(2)
    versions.add(1, _published({"w": w, "b": b}))
    got = versions.last_buffers()
    assert set(got) == {"w", "b"} and got["w"] is w and got["b"] is b
    copy = {"w": torch.zeros(4)}
    versions.add(2, _published(copy, copy_bytes=16))  # a private copy: not the caller's buffers
    assert versions.last_buffers()["w"] is w  # still the caller's last own buffers
    fresh = {"w": torch.full((4,), 2.0), "b": torch.full((2,), 3.0)}
    versions.add(3, _published(fresh))
    versions.supersede(4)  # a later publish: version 3's entry goes
    del got, fresh
    gc.collect()
    assert versions.last_buffers() == {}  # gone with the caller's last reference: never kept alive here
