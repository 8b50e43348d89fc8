"""Windows of concurrent rounds: part of the plan, the same cut on every rank."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_refit.layout.models import ModelConfig
from elastic_refit.plan import Phase, PlanOptions
from elastic_refit.testing.world import RefitCase
from elastic_refit.transport.schedule import Step, build_rank_schedule
from elastic_refit.transport.window import cut_windows

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
