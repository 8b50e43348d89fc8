"""The chaos oracle on synthetic logs: a clean trial passes, and each check can fail."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from elastic_refit.chaos.faults import TTL_S, Fault, FaultPlan, build_matrix
from elastic_refit.chaos.oracle import TrialEvidence, Violation, check_all

from elastic_refit.testing.logs import parse_log_lines

T0 = 1_800_000_000.0


def ev(name: str, t: float, **fields) -> dict:
    return {"event": name, "_t": T0 + t, **fields}


def clean() -> TrialEvidence:
    """Two trainers, two inference replicas, versions 1-2, i1 killed during version 2."""
    logs = {
        "t0-L0": [ev("refit.member.started", 0, layout_rank=0), ev("refit.epoch.entered", 0.1, epoch=1),
                  ev("refit.version.published", 0.2, version=1),
                  ev("refit.attempt.proposed", 0.3, epoch=1, seq=0, version=1, kind="refit", sources=2,
                     destinations=2),
                  ev("refit.plan.built", 0.31, epoch=1, seq=0, fingerprint="aa"),
                  ev("refit.plan.agreed", 0.32, epoch=1, seq=0),
                  ev("refit.transfer.done", 0.4, epoch=1, seq=0, version=1),
                  ev("refit.version.committed", 0.5, epoch=1, version=1, digest="d1"),
                  ev("refit.version.published", 0.6, version=2),
                  ev("refit.epoch.entered", 2.5, epoch=2),
                  ev("refit.plan.built", 2.6, epoch=2, seq=0, fingerprint="bb"),
                  ev("refit.plan.agreed", 2.61, epoch=2, seq=0),
                  ev("refit.version.committed", 2.9, epoch=2, version=2, digest="d2")],
        "i0-L0": [ev("refit.member.started", 0, layout_rank=2), ev("refit.epoch.entered", 0.1, epoch=1),
                  ev("refit.plan.built", 0.31, epoch=1, seq=0, fingerprint="aa"),
                  ev("refit.plan.agreed", 0.32, epoch=1, seq=0),
                  ev("refit.version.acked", 0.45, epoch=1, seq=0, version=1, digest="x1"),
                  ev("refit.version.serving", 0.55, version=1),
                  ev("refit.epoch.entered", 2.5, epoch=2),
                  ev("refit.plan.built", 2.6, epoch=2, seq=0, fingerprint="bb"),
                  ev("refit.plan.agreed", 2.61, epoch=2, seq=0),
                  ev("refit.version.acked", 2.8, epoch=2, seq=0, version=2, digest="x2"),
                  ev("refit.version.serving", 2.95, version=2)],
        "i1-L0": [ev("refit.member.started", 0, layout_rank=3), ev("refit.epoch.entered", 0.1, epoch=1),
                  ev("refit.plan.built", 0.31, epoch=1, seq=0, fingerprint="aa"),
                  ev("refit.plan.agreed", 0.32, epoch=1, seq=0),
                  ev("refit.version.acked", 0.45, epoch=1, seq=0, version=1, digest="x1")],
    }
    reports = {
        "t0-L0": {"committed": [{"version": 1}, {"version": 2}], "problems": []},
        "i0-L0": {"committed": [{"version": 1, "verified": True}, {"version": 2, "verified": True}],
                  "problems": []},
    }
    return TrialEvidence(logs=logs, committed={1: {"epoch": 1}, 2: {"epoch": 2}}, reports=reports, last_version=2,
                         victims=frozenset({"i1-L0"}), faults=({"index": 0, "t": T0 + 0.7},), expected_faults=1,
                         final=frozenset({"t0-L0", "i0-L0"}))


def categories(evidence: TrialEvidence) -> set[tuple[str, str]]:
    return {(v.category, v.check) for v in check_all(evidence).violations}


def test_clean_trial_passes_with_recovery_time():
    verdict = check_all(clean())
    assert verdict.passed, verdict.violations
    assert verdict.recovery_s == pytest.approx((2.2,), abs=1e-3)


def test_epochs_must_strictly_increase():
    e = clean()
    logs = dict(e.logs, **{"i0-L0": e.logs["i0-L0"] + [ev("refit.epoch.entered", 3.0, epoch=2)]})
    assert ("unsafe", "epochs_increase") in categories(replace(e, logs=logs))


def test_participants_must_agree_on_one_plan():
    e = clean()
    i1 = [dict(x, fingerprint="zz") if x["event"] == "refit.plan.built" else x for x in e.logs["i1-L0"]]
    assert ("unsafe", "one_plan") in categories(replace(e, logs=dict(e.logs, **{"i1-L0": i1})))


def test_an_attempt_proposed_twice_differently_is_caught():
    e = clean()
    extra = ev("refit.attempt.proposed", 0.35, epoch=1, seq=0, version=2, kind="refit", sources=1, destinations=2)
    assert ("unsafe", "one_plan") in categories(replace(e, logs=dict(e.logs, **{"t0-L0": e.logs["t0-L0"] + [extra]})))


def test_no_rank_applies_a_stale_epoch():
    e = clean()
    stale = ev("refit.version.acked", 3.0, epoch=1, seq=3, version=2, digest="x2")
    assert ("unsafe", "no_stale_epoch") in categories(replace(e, logs=dict(e.logs, **{"i0-L0": e.logs["i0-L0"] + [stale]})))
    assert ("unsafe", "no_stale_epoch") in categories(replace(e, committed={1: {"epoch": 3}, 2: {"epoch": 2}}))


def test_torn_versions_are_caught_three_ways():
    e = clean()
    bad_report = dict(e.reports["i0-L0"], problems=["w: 12 bytes differ"])
    assert ("torn", "bit_exact") in categories(replace(e, reports=dict(e.reports, **{"i0-L0": bad_report})))
    i1 = [dict(x, digest="other") if x["event"] == "refit.version.acked" else x for x in e.logs["i1-L0"]]
    i1[0] = dict(i1[0], layout_rank=2)  # same shard as i0: digests must agree
    assert ("torn", "ack_digests") in categories(replace(e, logs=dict(e.logs, **{"i1-L0": i1})))
    serving = e.logs["i0-L0"] + [ev("refit.version.serving", 4.0, version=3)]
    assert ("torn", "serves_committed") in categories(replace(e, logs=dict(e.logs, **{"i0-L0": serving})))


def test_lost_versions_are_caught():
    e = clean()
    assert ("lost", "no_version_lost") in categories(replace(e, committed={1: {"epoch": 1}}))
    short = dict(e.reports["i0-L0"], committed=[{"version": 1, "verified": True}])
    assert ("lost", "reached_last") in categories(replace(e, reports=dict(e.reports, **{"i0-L0": short})))


def test_hangs_are_caught():
    e = clean()
    assert ("hung", "deadline") in categories(replace(e, timed_out=True, deadline_s=60))
    assert ("hung", "reported") in categories(replace(e, missing=("i0-L0",)))
    timeout = {"error_type": "TimeoutError", "error": "not ready within 40 s"}
    assert ("hung", "timeout") in categories(replace(e, reports=dict(e.reports, **{"i0-L0": timeout})))


def test_leaks_are_caught():
    e = clean()
    assert ("leaked", "leases") in categories(replace(e, leases=(42,)))
    assert ("leaked", "processes") in categories(replace(e, stray_pids=(4242,)))
    leaky = dict(e.reports["i0-L0"], leftover_sockets=["a->b st=01"], leftover_threads=["refit-agent-i0"],
                 leftover_ipc_mappings=["0x7f0000000000+2097152"])
    found = categories(replace(e, reports=dict(e.reports, **{"i0-L0": leaky})))
    assert {("leaked", "sockets"), ("leaked", "threads"), ("leaked", "ipc_mappings")} <= found


def test_only_victims_may_fail_and_every_fault_must_fire():
    e = clean()
    fenced = {"error_type": "MembershipLost", "error": "lease expired"}
    assert check_all(replace(e, reports=dict(e.reports, **{"i1-L0": fenced}))).passed
    assert ("error", "members") in categories(replace(e, reports=dict(e.reports, **{"i0-L0": fenced})))
    assert ("error", "faults_fired") in categories(replace(e, faults=()))


def test_a_process_that_ended_without_a_fault_is_named_with_its_exit_code():
    # t0 vanished after its last commit (its worker read EOF): gone, so the other checks
    # excuse it, but the crash itself is the finding, never hidden.
    e = replace(clean(), victims=frozenset({"i1-L0", "t0-L0"}), crashed={"t0-L0": -11})
    verdict = check_all(e)
    assert [(v.category, v.check) for v in verdict.violations] == [("error", "crashed")]
    assert "t0-L0" in verdict.violations[0].detail and "-11" in verdict.violations[0].detail
    assert check_all(replace(e, crashed={})).passed


def test_log_parsing_skips_cut_lines():
    lines = [json.dumps({"event": "refit.version.committed", "timestamp": "2026-11-29T08:15:16.064Z"}),
             '{"event": "refit.vers', "plain text"]
    events = parse_log_lines(lines)
    assert len(events) == 1 and events[0]["_t"] > 0


def test_violation_and_plans_validate_input():
    with pytest.raises(ValueError, match="category"):
        Violation("bad", "x", "y")
    with pytest.raises(ValueError, match="earlier fault"):
        FaultPlan((Fault("kill", "trainer", "transfer", after=0),))
    with pytest.raises(ValueError, match="coordinator"):
        FaultPlan().kill(role="trainer", rank=0, at="commit")
    with pytest.raises(ValueError, match="duration_s"):
        FaultPlan().stop(role="inference", rank=1, at="transfer", duration_s=0)
    with pytest.raises(ValueError, match="matrix"):
        build_matrix("huge")


def test_matrices_are_reproducible():
    assert build_matrix("full", trials=60, seed=3) == build_matrix("full", trials=60, seed=3)
    assert build_matrix("full", trials=60, seed=3) != build_matrix("full", trials=60, seed=4)
    assert len(build_matrix("full")) >= 200


def test_cluster_matrix_runs_every_scenario_on_three_nodes_and_adds_member_down_cells():
    full = build_matrix("full", trials=200, seed=1, etcd_nodes=3)
    assert {s.etcd_nodes for s in full} == {3}
    assert all(s.name.endswith("(etcd x3)") for s in full)
    down = [s for s in full if s.fault == "etcd_member_down"]
    assert {s.phase for s in down} == {"transfer", "commit"}
    # down for longer than the trial's remaining refits: they must go through two nodes
    assert all(f.duration_s > 2 * TTL_S for s in down for f in s.plan.faults)
    assert not [s for s in build_matrix("full", trials=200, seed=1) if s.fault == "etcd_member_down"]
    quick = build_matrix("quick", etcd_nodes=3)
    assert {s.victim for s in quick} == {"etcd", "inference"}
    assert {s.fault for s in quick if s.victim == "etcd"} >= {"etcd_restart<ttl", "etcd_member_down"}
    with pytest.raises(ValueError, match="etcd_nodes"):
        build_matrix("quick", etcd_nodes=2)


def test_only_killed_incarnations_may_be_fenced():
    """A confirmed suspicion of an incarnation no fault killed is a false positive of the
    crash detector (unsafe/no_live_member_fenced); of a killed one it is the fast path."""
    e = clean()
    kill = {"index": 0, "t": T0 + 0.7, "kind": "kill", "member_id": "i1", "life": 0}
    e = replace(e, faults=(kill,), logs={**e.logs, "i1-L0-ab12": e.logs["i1-L0"]})

    def fenced(incarnation: str) -> TrialEvidence:
        confirmed = ev("membership.suspect.confirmed", 0.8, suspect=incarnation.split("-")[0],
                       incarnation=incarnation, evidence="closed")
        return replace(e, logs=dict(e.logs, **{"t0-L0": e.logs["t0-L0"] + [confirmed]}))

    assert ("unsafe", "no_live_member_fenced") not in categories(fenced("i1-L0-ab12"))
    assert ("unsafe", "no_live_member_fenced") in categories(fenced("i0-L0-cd34"))
    # A slow (or stopped) rank is no killed one.
    slow = replace(fenced("i1-L0-ab12"), faults=(dict(kill, kind="slow"),))
    assert ("unsafe", "no_live_member_fenced") in categories(slow)


def test_a_rejoined_process_checks_each_incarnation_s_epochs_on_their_own():
    """A member that lost its lease rejoins in its process as a new incarnation (one log, two
    incarnations): the new one enters the current epoch again, which is no step back."""
    e = clean()
    rejoined = [dict(x, incarnation="a") for x in e.logs["i0-L0"]] + [
        ev("refit.epoch.entered", 3.0, epoch=2, incarnation="b")]
    assert categories(replace(e, logs=dict(e.logs, **{"i0-L0": rejoined}))) == set()
    again = rejoined + [ev("refit.epoch.entered", 3.5, epoch=1, incarnation="b")]
    assert ("unsafe", "epochs_increase") in categories(replace(e, logs=dict(e.logs, **{"i0-L0": again})))


def test_after_a_wipe_every_member_stops_and_nothing_commits_or_is_served():
    e = clean()
    wiped = {"index": 0, "t": T0 + 0.7, "kind": "etcd_wipe"}
    stopped = {inc: {"error_type": "JobStateLost", "error": "the job's control state ..."} for inc in e.reports}
    # Version 2's commit and serving in clean() come after the wipe: caught.
    base = replace(e, faults=(wiped,), reports=stopped, victims=frozenset())
    assert ("unsafe", "stops_on_wipe") in categories(base)
    before = {inc: [x for x in events if x["_t"] < T0 + 0.7] for inc, events in e.logs.items()}
    assert check_all(replace(base, logs=before)).passed, check_all(replace(base, logs=before)).violations
    went_on = dict(stopped, **{"t0-L0": {"committed": [{"version": 1}], "problems": []}})
    assert ("unsafe", "stops_on_wipe") in categories(replace(base, logs=before, reports=went_on))


def test_a_member_config_may_put_every_member_in_one_domain():
    """Colocated trials (tests/gpu/test_colocated_runtime_gpu.py) give every member one
    domain through the scenario's member config."""
    from elastic_refit.testing.job import MemberSpec

    spec = MemberSpec("job", "trainer", "t0", 0, ("localhost:2379",), "d-train",
                      config={"domain": "host-0", "same_host": "ipc", "device": "cuda:0"})
    config = spec.refit_config()
    assert config.domain == "host-0" and config.transfer.same_host == "ipc"
    assert MemberSpec("job", "trainer", "t0", 0, ("localhost:2379",), "d-train").refit_config().domain == "d-train"


def test_group_holders_names_who_keeps_a_transport_alive():
    """The leaked-socket diagnostic names the object (and the running frame) that holds a
    transport: gloo's sockets go only when their group goes."""
    import torch.distributed as dist
    from elastic_refit.chaos.worker import group_holders

    from elastic_refit.transport.c10d import C10dTransport

    class Keeper:
        pass

    keeper = Keeper()
    keeper.transport = C10dTransport.create(dist.HashStore(), 0, 1)
    holders = [h for h in group_holders() if h.startswith("C10dTransport")]
    assert len(holders) == 1 and "Keeper" in holders[0], holders
    assert "[locals of" not in holders[0]  # no running frame holds it itself
    local = keeper.transport
    assert "[locals of frame test_group_holders_names_who_keeps_a_transport_alive" in group_holders()[0]
    del keeper, local
    group_holders()  # reading a frame's locals (3.11) kept a snapshot of them on the frame: this refreshes it
    assert not [h for h in group_holders() if h.startswith("C10dTransport")]
