"""``bench soak``'s figures from its members' reports and samples (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastic_refit.testing.job import CommitRecord
from elastic_refit.testing.soak import (
    INFERENCE,
    TRAINERS,
    SoakConfig,
    interleave_schedule,
    summarize,
)


def _recorded(entries, window: int | None) -> dict:
    record = CommitRecord(window)
    for entry in entries:
        record.append(entry)
    return record.report()


def _reports(num_versions: int, seconds, problems=(), skipped: int | None = None, window: int | None = None) -> dict:
    """Reports as the soak's members make them (``CommitRecord`` with the soak's window)."""
    versions = range(1, num_versions + 1)
    out = {t: _recorded([{"version": v, "seconds": s} for v, s in zip(versions, seconds, strict=True)
                         if v != skipped], window) for t in TRAINERS}
    for i in INFERENCE:
        out[i] = _recorded([{"version": v, "verified": True} for v in versions if v != skipped], window) | {
            "problems": list(problems)}
    return out


def _samples(keys, rss):
    return [{"t": float(k), "version": 10 * k, "keys": n, "db_bytes": 1000 + k, "rss": {"i0": r, "t0": r // 2}}
            for k, (n, r) in enumerate(zip(keys, rss, strict=True))]


def test_overheads_are_the_first_and_last_windows_and_memory_the_largest_member():
    config = SoakConfig(num_versions=40, window=10)
    seconds = [0.1] * 10 + [0.5] * 20 + [0.2] * 10
    out = summarize(config, _reports(40, seconds), _samples([30, 50, 40], [100, 300, 200]), final_keys=35)
    assert out["window"] == 10 and out["verified"] == 40 and out["problems"] == 0
    assert out["first_overhead_s"] == pytest.approx(0.1) and out["last_overhead_s"] == pytest.approx(0.2)
    assert out["overhead_ratio"] == pytest.approx(2.0)
    assert (out["etcd_keys_max"], out["etcd_keys_final"]) == (50, 35)
    # first sample past start-up (version >= window // 10) and the last one
    assert (out["member_rss_first_bytes"], out["member_rss_last_bytes"]) == (300, 200)


def test_the_members_keep_only_their_first_and_last_windows_and_the_figures_are_the_same():
    config = SoakConfig(num_versions=100, window=10)
    seconds = [0.1] * 10 + [0.7] * 80 + [0.3] * 10
    whole, bounded = _reports(100, seconds), _reports(100, seconds, window=10)
    assert len(bounded["t0"]["committed"]) == 20 and bounded["t0"]["num_committed"] == 100
    assert [c["version"] for c in bounded["t0"]["committed"]] == [*range(1, 11), *range(91, 101)]
    assert summarize(config, bounded, [], 0) == summarize(config, whole, [], 0)
    assert summarize(config, bounded, [], 0)["last_overhead_s"] == pytest.approx(0.3)


@pytest.mark.parametrize("window", [None, 5])
def test_a_trainer_version_missing_or_out_of_order_means_nothing_counts_as_verified(window):
    config = SoakConfig(num_versions=20, window=10)
    assert summarize(config, _reports(20, [0.1] * 20, window=window), [], 0)["verified"] == 20
    assert summarize(config, _reports(20, [0.1] * 20, skipped=7, window=window), [], 0)["verified"] == 0
    swapped = _reports(20, [0.1] * 20, window=window)
    swapped["t1"] = _recorded([{"version": v, "seconds": 0.1} for v in [*range(1, 9), 10, 9, *range(11, 21)]],
                              window)
    assert summarize(config, swapped, [], 0)["verified"] == 0


def test_a_record_window_must_be_positive():
    with pytest.raises(ValueError, match="record window"):
        CommitRecord(0)


def test_a_problem_on_any_inference_rank_means_nothing_counts_as_verified():
    config = SoakConfig(num_versions=20, window=10)
    out = summarize(config, _reports(20, [0.1] * 20, problems=["rank 2 tensor 'w': 1 bytes differ"]), [], 0)
    assert out["verified"] == 0 and out["problems"] == len(INFERENCE)


def test_a_window_larger_than_half_the_versions_is_cut_to_half():
    out = summarize(SoakConfig(num_versions=20, window=1000), _reports(20, [1.0] * 10 + [3.0] * 10), [], 0)
    assert out["window"] == 10 and out["overhead_ratio"] == pytest.approx(3.0)


@pytest.mark.parametrize(("fields", "message"), [({"num_versions": 5}, "--versions"), ({"window": 2}, "--window"),
                                                 ({"block": 0}, "--block")])
def test_config_refuses_too_few_versions_or_a_tiny_window(fields, message):
    with pytest.raises(ValueError, match=message):
        SoakConfig(**fields)


def _rss_samples(rss_by_version):
    return [{"t": float(v), "version": v, "keys": 40, "db_bytes": 1000, "rss": {"i0": r, "t0": r // 2}}
            for v, r in rss_by_version]


def test_memory_that_grows_only_while_warming_up_has_a_flat_second_half():
    config = SoakConfig(num_versions=1000, window=100)
    warm_up = [(v, 200_000_000 + 20_000 * v) for v in range(10, 500, 10)]  # +10 MB by version 500
    flat = [(v, 210_000_000) for v in range(500, 1001, 10)]
    out = summarize(config, _reports(1000, [0.1] * 1000), _rss_samples(warm_up + flat), 40)
    assert out["member_rss_second_half_slope_bytes_per_1000_versions"] == pytest.approx(0.0, abs=1.0)
    assert out["member_rss_second_half_growth"] == pytest.approx(0.0)
    assert len(out["member_rss_by_tenth_bytes"]) == 10 and out["member_rss_by_tenth_bytes"][-1] == 210_000_000


def test_a_leak_shows_as_a_slope_per_thousand_versions():
    config = SoakConfig(num_versions=1000, window=100)
    leak = [(v, 200_000_000 + 3_000 * v) for v in range(10, 1001, 10)]  # 3 KB per version
    out = summarize(config, _reports(1000, [0.1] * 1000), _rss_samples(leak), 40)
    assert out["member_rss_second_half_slope_bytes_per_1000_versions"] == pytest.approx(3_000_000, rel=1e-6)
    assert out["member_rss_second_half_growth"] > 0.005


def test_too_few_samples_give_no_trend():
    out = summarize(SoakConfig(num_versions=20, window=10), _reports(20, [0.1] * 20), _rss_samples([(5, 1), (9, 2)]),
                    0)
    assert out["member_rss_by_tenth_bytes"] == [] and out["member_rss_second_half_slope_bytes_per_1000_versions"] is None


def test_memory_figures_are_the_steepest_members_not_the_slope_of_whichever_is_largest():
    config = SoakConfig(num_versions=1000, window=100)
    # i0 is the largest but flat; t0 is smaller and leaks 2 KB per version.
    samples = [{"t": float(v), "version": v, "keys": 40, "db_bytes": 1000,
                "rss": {"i0": 300_000_000, "t0": 200_000_000 + 2_000 * v}} for v in range(10, 1001, 10)]
    out = summarize(config, _reports(1000, [0.1] * 1000), samples, 40)
    assert out["member_rss_second_half_slope_bytes_per_1000_versions"] == pytest.approx(2_000_000, rel=1e-6)
    assert out["member_rss_second_half_slope_by_member"]["i0"] == 0
    assert out["member_rss_by_tenth_bytes"][-1] == 300_000_000  # the largest member's RSS


def test_cpu_per_version_is_taken_between_the_samples_that_bracket_each_window():
    config = SoakConfig(num_versions=1000, window=100)
    # 10 ms of CPU per version up to version 500, 30 ms after; start-up (before v10) costs 50 s.
    def cpu(v):
        return 50.0 + 0.01 * min(v, 500) + 0.03 * max(v - 500, 0) if v >= 10 else 0.0
    samples = [{"t": float(v), "version": v, "keys": 40, "db_bytes": 1000, "rss": {"i0": 1}, "cpu_s": cpu(v)}
               for v in [0, *range(10, 1001, 10)]]
    out = summarize(config, _reports(1000, [0.1] * 1000), samples, 40)
    assert out["first_cpu_s_per_version"] == pytest.approx(0.01)  # from v10 on: start-up left out
    assert out["last_cpu_s_per_version"] == pytest.approx(0.03)
    assert out["cpu_ratio"] == pytest.approx(3.0)
    without = summarize(config, _reports(1000, [0.1] * 1000), [{**s, "cpu_s": None} for s in samples], 40)
    assert without["first_cpu_s_per_version"] is None and without["cpu_ratio"] is None


def test_the_last_window_is_also_compared_with_a_fresh_reference_job_timed_beside_it():
    config = SoakConfig(num_versions=1000, window=100)
    seconds = [0.1] * 500 + [0.15] * 500  # 1.5x slower at the end ...
    reference = _reports(100, [0.14] * 100)  # ... and a fresh job at the same time nearly as slow
    # Samples: the long job's CPU time grows 10 ms per version, the reference's 14 ms per
    # version while it runs (versions 1-100, during the long job's last 100).
    samples = [{"t": float(v), "version": v, "keys": 40, "db_bytes": 1000, "rss": {"i0": 1}, "cpu_s": 0.01 * v,
                "reference_version": max(0, v - 900), "reference_cpu_s": 0.014 * max(0, v - 900)}
               for v in range(0, 1001, 10)]
    out = summarize(config, _reports(1000, seconds), samples, 40, reference=reference)
    assert out["overhead_ratio"] == pytest.approx(1.5)
    assert out["reference_overhead_s"] == pytest.approx(0.14)
    assert out["overhead_ratio_same_time"] == pytest.approx(0.15 / 0.14)
    assert out["reference_verified"] == out["reference_versions"] == 100 and out["reference_problems"] == 0
    assert out["reference_cpu_s_per_version"] == pytest.approx(0.014)
    assert out["cpu_ratio_same_time"] == pytest.approx(0.01 / 0.014)
    # no reference job: none of its figures
    assert not any(k.startswith("reference") or k.endswith("same_time")
                   for k in summarize(config, _reports(1000, seconds), samples, 40))


def test_a_problem_in_the_reference_job_means_its_versions_do_not_count_as_verified():
    config = SoakConfig(num_versions=100, window=10)
    reference = _reports(10, [0.1] * 10, problems=["rank 1 tensor 'w': 3 bytes differ"])
    out = summarize(config, _reports(100, [0.1] * 100), [], 0, reference=reference)
    assert out["verified"] == 100 and out["reference_verified"] == 0 and out["reference_problems"] == len(INFERENCE)


def test_the_schedule_runs_the_long_job_alone_then_takes_turns_in_blocks_each_pair_flipped():
    assert interleave_schedule(1000, 100, 30) == (
        ("long", 900),
        ("long", 930), ("reference", 30),
        ("reference", 60), ("long", 960),
        ("long", 990), ("reference", 90),
        ("reference", 100), ("long", 1000))
    assert interleave_schedule(1000, 100, 30, reference=False) == (("long", 1000),)


@given(num_versions=st.integers(20, 5000), window_fraction=st.floats(0.01, 0.5), block=st.integers(1, 3000))
def test_every_schedule_ends_with_both_jobs_done_and_each_job_only_moves_forward(num_versions, window_fraction,
                                                                                 block):
    window = max(1, min(num_versions // 2, int(num_versions * window_fraction)))
    steps = interleave_schedule(num_versions, window, block)
    last = {"long": 0, "reference": 0}
    for job, version in steps:
        assert version > last[job]  # every step lets its job publish more
        last[job] = version
    assert last == {"long": num_versions, "reference": window}
    # the reference runs only during the long job's last window
    long_at = 0
    for job, version in steps:
        if job == "long":
            long_at = version
        else:
            assert long_at >= num_versions - window


def test_a_schedule_refuses_a_window_over_half_or_an_empty_block():
    with pytest.raises(ValueError, match="window"):
        interleave_schedule(100, 51, 10)
    with pytest.raises(ValueError, match="block"):
        interleave_schedule(100, 50, 0)
