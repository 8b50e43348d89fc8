"""Windows of concurrent rounds: part of the plan, the same cut on every rank; the executor's
records of one window follow its steps."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_refit.layout import parse_spec
from elastic_refit.layout.models import ModelConfig
from elastic_refit.plan import Phase, PlanOptions, make_plan
from elastic_refit.testing.world import RefitCase
from elastic_refit.transport.schedule import Step, build_rank_schedule
from elastic_refit.transport.window import Window, cut_windows

from .relay_cases import RELAY_SPEC

TINY = ModelConfig(name="tiny-llama", hidden_size=64, num_layers=3, vocab_size=250, num_heads=4, num_kv_heads=2,
                   head_dim=16, intermediate_size=96)
CASE = RefitCase(model=TINY, source="tp=2,pp=2", destination="tp=2,dp=2", domain_size=4, bucket_bytes=8192)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_concurrent_rounds_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="concurrent_rounds"):
        PlanOptions(concurrent_rounds=bad)


def test_concurrency_is_part_of_the_fingerprint_and_one_round_keeps_the_old_one():
    one = CASE.plan()
    assert RefitCase(**{**_fields(CASE), "concurrent_rounds": 1}).plan().fingerprint == one.fingerprint
    two = RefitCase(**{**_fields(CASE), "concurrent_rounds": 2}).plan()
    assert two.fingerprint != one.fingerprint
    # the rows are the same plan; only how many rounds run at once differs
    assert (two.transfers.nbytes == one.transfers.nbytes).all()


@settings(max_examples=50, deadline=None)
@given(rounds=st.lists(st.tuples(st.sampled_from(list(Phase)), st.integers(0, 20)), unique=True, max_size=30),
       width=st.integers(1, 8))
def test_windows_cut_by_phase_and_round_number_only(rounds, width):
    steps = tuple(Step(phase, r, None, None) for phase, r in sorted(rounds))
    windows = cut_windows(steps, width)
    assert [s for w in windows for s in w] == list(steps)  # every step once, in order
    for w in windows:
        assert len({s.phase for s in w}) == 1  # a fan-out never runs beside the deliveries it copies
        assert len({s.round // width for s in w}) == 1
    keys = [(int(w[0].phase), w[0].round // width) for w in windows]
    assert keys == sorted(set(keys))


def test_every_rank_of_a_plan_opens_the_same_windows():
    plan = RefitCase(**{**_fields(CASE), "concurrent_rounds": 2}).plan()
    per_rank = {}
    for rank in sorted(set(plan.source.ranks) | set(plan.destination.ranks)):
        for w in cut_windows(build_rank_schedule(plan, rank).steps, 2):
            per_rank.setdefault(rank, set()).add((w[0].phase, w[0].round // 2))
            for step in w:  # a peer's half of each message sits in the same window
                for msg, peer in ((step.send, step.send and step.send.peer), (step.recv, step.recv and step.recv.peer)):
                    if msg is not None:
                        other = build_rank_schedule(plan, peer).steps
                        assert any(o.phase == step.phase and o.round == step.round for o in other)
    assert per_rank


def _fields(case: RefitCase) -> dict:
    return {name: getattr(case, name) for name in case.__slots__}


@pytest.mark.parametrize("concurrent_rounds", [1, 2])
def test_a_windows_records_follow_its_steps_on_every_rank_of_a_relayed_plan(concurrent_rounds):
    """The executor's records of a window (``Window.of``): one per message and forward, in
    posting order; every forward a relay sends reads the message received in its own step;
    the batches cover every bucket of every message, plus one for the last forwards."""
    spec = parse_spec(json.loads(json.dumps(RELAY_SPEC)))
    plan = make_plan(spec.source, spec.destination, spec.topology,
                     PlanOptions(relay="on", bucket_bytes=256, concurrent_rounds=concurrent_rounds))
    assert plan.relayed
    num_forwards = num_multi_bucket = 0
    for rank in sorted(set(plan.source.ranks) | set(plan.destination.ranks)):
        for steps in cut_windows(build_rank_schedule(plan, rank).steps, concurrent_rounds):
            w = Window.of(steps, {})
            assert [m.msg for m in w.sends] == [s.send for s in steps if s.send is not None]
            assert [m.msg for m in w.recvs] == [s.recv for s in steps if s.recv is not None]
            assert [f.forward for f in w.forward_sends] == [f for s in steps for f in s.forward_sends]
            assert [f.forward for f in w.forward_recvs] == [f for s in steps for f in s.forward_recvs]
            for step in steps:
                for forward in step.forward_sends:
                    record = next(f for f in w.forward_sends if f.forward is forward)
                    assert record.source is not None and record.source.msg is step.recv
                    assert max(record.parts) < len(step.recv.buckets)  # parts travel with its buckets
            assert [m.msg for m in w.relayed] == [s.recv for s in steps if s.forward_sends]
            last = max([len(m.msg.buckets) for m in w.sends + w.recvs]
                       + [p.bucket + 1 for f in w.forward_sends + w.forward_recvs for p in f.forward.parts])
            assert w.num_batches == last + 1
            assert all(m.slots == [None, None] and m.first_slot is None for m in w.sends + w.recvs)
            num_forwards += len(w.forward_sends)
            num_multi_bucket += sum(len(m.msg.buckets) > 1 for m in w.recvs)
    assert num_forwards and num_multi_bucket  # the case exercises what it claims to
