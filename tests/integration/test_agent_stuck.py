"""A member whose agent thread is stuck where no deadline reaches (as a GPU call that never
returns) leaves the job, says where it was, and the others go on. Real etcd, real gloo; the
members run in this process. On the H100 (2026-12-07) such a member held its lease and its
peers re-formed every 30 s for good."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from elastic_refit.errors import AgentStuck
from elastic_refit.runtime import ElasticRefit, RefitConfig
from elastic_refit.runtime.phases import PhaseHooks
from elastic_refit.testing.pattern import allocate, check_pieces, fill_pieces

from .conftest import wait_until
from .test_causes import DESTINATION, SOURCE

pytestmark = pytest.mark.etcd

STUCK_S = 5.0  # above the epoch deadline below, as the setting requires


def _wedged_at(phase: str, version: int, release: threading.Event):
    def hook(name, context) -> None:
        if name == phase and context.get("version") == version:
            release.wait(120)  # like a stream synchronize behind a kernel whose peers gave up
    return hook


def test_a_stuck_agent_leaves_the_job_and_says_where(etcd_server, job):
    release = threading.Event()
    events: list[tuple[str, dict]] = []

    def cfg(role: str, member_id: str, rank: int) -> RefitConfig:
        return RefitConfig(job=job, role=role, member_id=member_id, layout_rank=rank, etcd=(etcd_server.endpoint,),
                           domain=f"d-{role}", ttl_s=2, epoch_deadline_s=4.0, agent_stuck_s=STUCK_S,
                           version_timeout_s=60.0)

    params = {m: allocate(DESTINATION, r, fill=0) for m, r in (("i0", 1), ("i1", 2))}
    with contextlib.ExitStack() as stack:
        i0 = stack.enter_context(ElasticRefit(cfg("inference", "i0", 1), DESTINATION, parameters=params["i0"]))
        i1 = stack.enter_context(ElasticRefit(
            cfg("inference", "i1", 2), DESTINATION, parameters=params["i1"], on_event=lambda name, fields: events.append((name, fields)),
            hooks=PhaseHooks(hooks=(_wedged_at("ack.before", 2, release),))))
        trainer = stack.enter_context(ElasticRefit(cfg("trainer", "t0", 0), SOURCE))
        try:
            for version in (1, 2, 3):
                tensors = allocate(SOURCE, 0, fill=0)
                fill_pieces(SOURCE, 0, tensors, seed=version)
                started = time.monotonic()
                trainer.publish(tensors, version)
                if version == 2:  # committed only once i1, stuck before its ack, left the job
                    assert time.monotonic() - started >= STUCK_S - 1.0
            assert i0.wait_for_version(3, timeout_s=30) >= 3
            with i0.weights():
                assert not check_pieces(DESTINATION, 1, params["i0"], seed=3)
            with pytest.raises(AgentStuck, match=r"i1: the refit agent has been in RunAttempt for \d+ s.*"
                                                 r"test_agent_stuck.py:\d+ in hook; this member leaves the job"):
                i1.wait_for_version(2, timeout_s=5)
            wait_until(lambda: "i1" not in [m.member_id for m in trainer.membership.view.members], 10,
                       "the epoch without i1")
        finally:
            release.set()
    stuck = [fields for name, fields in events if name == "refit.agent.stuck"]
    assert len(stuck) == 1 and stuck[0]["action"] == "RunAttempt", stuck
    assert "ack.before" in stuck[0]["stack"] and "release.wait" in stuck[0]["stack"]  # the whole way in
