"""The quick chaos matrix against a real etcd and real member processes (CI).

One trial per key cell (victim x fault x phase); the oracle must find nothing torn, lost,
hung or leaked, and no other violation. Cells excluded for known runtime bugs are listed
with their reason in ``chaos.faults.QUICK_EXCLUDED`` and still run in the full matrix."""

from __future__ import annotations

import pytest
from elastic_refit.chaos.faults import build_matrix

from tests.chaos.matrix import assert_matrix_finds_nothing

pytestmark = [pytest.mark.chaos, pytest.mark.etcd]


@pytest.mark.timeout(420)
def test_quick_matrix_finds_nothing(chaos_run):
    scenarios = build_matrix("quick", seed=0)
    assert len(scenarios) >= 8
    assert_matrix_finds_nothing(scenarios, chaos_run)


@pytest.mark.timeout(480)
def test_quick_matrix_with_deltas_finds_nothing(chaos_run):
    """The same cells with deltas on: ranks holding the latest commit get deltas, a killed
    and restarted rank or a joiner gets full bytes; nothing torn, lost, hung or leaked."""
    from elastic_refit.chaos.faults import with_deltas

    scenarios = with_deltas(build_matrix("quick", seed=0))
    assert_matrix_finds_nothing(scenarios, chaos_run)
