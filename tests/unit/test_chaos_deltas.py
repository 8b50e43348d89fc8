"""The chaos matrix with deltas on (``chaos.faults.with_deltas``, ``elastic-refit chaos
--deltas``): the same cells, every member configured for deltas and versions that change a
little from one to the next, passed on to the members."""

from __future__ import annotations

import pytest
from elastic_refit.chaos.faults import DELTA_CONFIG, build_matrix, with_deltas


def test_with_deltas_keeps_the_cells_and_turns_deltas_on():
    plain = build_matrix("quick", seed=0)
    deltas = with_deltas(plain)
    assert [s.name for s in deltas] == [f"{s.name} +deltas" for s in plain]
    for before, after in zip(plain, deltas, strict=True):
        assert after.plan == before.plan and after.seed == before.seed
        assert after.delta_density == 0.02
        assert {**(before.member_config or {}), **DELTA_CONFIG} == dict(after.member_config)


def test_with_deltas_refuses_a_density_outside_0_1():
    with pytest.raises(ValueError, match="density"):
        with_deltas(build_matrix("quick", seed=0), density=0.0)

