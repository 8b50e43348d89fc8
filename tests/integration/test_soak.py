"""``bench soak`` end to end, short: every version verified, and what a version costs etcd."""

from __future__ import annotations

import pytest

from elastic_refit.testing.soak import SoakConfig, run_soak

pytestmark = pytest.mark.etcd


def test_a_short_soak_verifies_every_version_in_few_etcd_requests_each():
    # Window 10 in turns of 5 with a fresh reference job: long 1-20 alone, then long 21-25,
    # reference 1-5, reference 6-10, long 26-30; each turn waits for the one before.
    result = run_soak(SoakConfig(num_versions=30, window=10, block=5, idle_s=0.0, timeout_s=300.0))
    assert result["verified"] == 30 and result["problems"] == 0
    assert result["served_checked_min"] >= 1
    assert result["reference_verified"] == result["reference_versions"] == 10 and result["reference_problems"] == 0
    assert result["overhead_ratio_same_time"] > 0
    # Six members, a version: a publish per trainer, a plan key, a done key (with the ack)
    # and an agreement read per member, the coordinator's propose, commit and prunes, plus
    # the members' watch streams. Reading the whole version state on every wakeup, and the
    # store's values one key at a time, cost over 200.
    assert result["etcd_requests_per_version"] < 100, result
