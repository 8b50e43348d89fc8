"""The coordinator's delta choice (``runtime.deltas.with_deltas``) as tables: a delta goes
only to a destination that holds the latest committed version verified (its ack standing in
its current incarnation and layout); never to a joiner, a restarted rank, a rank that
changed its layout or retracted its ack; never in a catch-up."""

from __future__ import annotations

from dataclasses import replace

import pytest
from elastic_refit.membership.attempts import CATCH_UP, REFIT, AttemptSpec
from elastic_refit.membership.versions import Ack
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_refit.runtime.attempt import holds
from elastic_refit.runtime.deltas import with_deltas
from tests.unit.test_runtime_decisions import state
from tests.unit.test_runtime_decisions import view as plain_view

DESTS = ("i0", "i1", "i2")


def view(*members: str, without: tuple[str, ...] = ()):
    """A view whose members take deltas (their records say so), but ``without``."""
    v = plain_view(*members)
    return replace(v, members=tuple(replace(m, deltas=m.member_id not in without) for m in v.members))


def refit(version: int = 5, destinations=DESTS, kind: str = REFIT) -> AttemptSpec:
    sources = ("t0",) if kind == REFIT else ()
    holders = () if kind == REFIT else ("i9",)
    return AttemptSpec(version, kind, sources, holders, destinations)


def _changed_layout(s):
    s.acks[4]["i1"] = replace(s.acks[4]["i1"], layout="old-layout")
    return s


CASES = {
    # name: (spec, view members, state, enabled, expected (base, deltas))
    "every destination holds the base": (refit(), ("t0", *DESTS), state(acks={4: list(DESTS)}, committed=(4,)),
                                         True, (4, DESTS)),
    "deltas off": (refit(), ("t0", *DESTS), state(acks={4: list(DESTS)}, committed=(4,)), False, (None, ())),
    "nothing committed yet": (refit(), ("t0", *DESTS), state(acks={4: list(DESTS)}), True, (None, ())),
    "a joiner (no ack) gets full bytes": (refit(), ("t0", *DESTS), state(acks={4: ["i0", "i1"]}, committed=(4,)),
                                          True, (4, ("i0", "i1"))),
    "a restarted rank (older incarnation's ack) gets full bytes": (
        refit(), ("t0", *DESTS), state(acks={4: ["i0", "i1@old", "i2"]}, committed=(4,)), True, (4, ("i0", "i2"))),
    "a rank that missed the base (acked an older version) gets full bytes": (
        refit(), ("t0", *DESTS), state(acks={4: ["i0", "i1"], 3: ["i2"]}, committed=(3, 4)), True, (4, ("i0", "i1"))),
    "the base is the latest committed version, not the one before": (
        refit(version=9), ("t0", *DESTS), state(acks={4: list(DESTS), 7: ["i0"]}, committed=(4, 7)), True,
        (7, ("i0",))),
    "nobody holds the base": (refit(), ("t0", *DESTS), state(acks={4: []}, committed=(4,)), True, (None, ())),
    "a catch-up sends full bytes": (refit(4, ("i2",), CATCH_UP), ("i9", *DESTS),
                                    state(acks={4: ["i0", "i1", "i9"]}, committed=(4,)), True, (None, ())),
    "a rank that changed its layout gets full bytes": (
        refit(), ("t0", *DESTS), _changed_layout(state(acks={4: list(DESTS)}, committed=(4,))), True,
        (4, ("i0", "i2"))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_with_deltas(name):
    spec, members, versions, enabled, (base, deltas) = CASES[name]
    out = with_deltas(spec, view(*members), versions, enabled=enabled)
    assert (out.base, out.deltas) == (base, deltas)
    assert replace(out, base=None, deltas=()) == replace(spec, base=None, deltas=())  # nothing else changes


@pytest.mark.parametrize("without", ["t0", "i1"])
def test_a_member_without_deltas_makes_the_attempt_go_in_full(without):
    """Deltas need every sender and receiver of the attempt to exchange sizes: one member
    whose record says it takes none (no delta_base_bytes there) -> full bytes for all,
    decided with the attempt (no attempt fails on it)."""
    spec = refit()
    versions = state(acks={4: list(DESTS)}, committed=(4,))
    out = with_deltas(spec, view("t0", *DESTS, without=(without,)), versions)
    assert (out.base, out.deltas) == (None, ())
    assert with_deltas(spec, view("t0", *DESTS), versions).deltas == DESTS


def test_spec_refuses_deltas_without_a_base_or_outside_its_destinations():
    with pytest.raises(ValueError, match="base"):
        AttemptSpec(5, REFIT, ("t0",), (), ("i0",), deltas=("i0",))
    with pytest.raises(ValueError, match="base"):
        AttemptSpec(5, REFIT, ("t0",), (), ("i0",), base=5, deltas=("i0",))
    with pytest.raises(ValueError, match="destinations only"):
        AttemptSpec(5, REFIT, ("t0",), (), ("i0",), base=4, deltas=("i1",))


def test_spec_round_trips_its_deltas():
    spec = AttemptSpec(5, REFIT, ("t0",), (), ("i0", "i1"), base=4, deltas=("i1",))
    assert AttemptSpec.from_json(spec.to_json()) == spec
    plain = AttemptSpec(5, REFIT, ("t0",), (), ("i0",))
    assert "deltas" not in plain.to_json() and AttemptSpec.from_json(plain.to_json()) == plain


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_never_a_delta_without_the_verified_base(data):
    """Random acks, incarnations, layouts and commits: every destination named for a delta
    holds the base (its ack in its current incarnation and layout)."""
    names = [f"i{k}" for k in range(data.draw(st.integers(1, 5)))]
    committed = tuple(sorted(data.draw(st.sets(st.integers(0, 6), max_size=3))))
    acks = {v: [n + data.draw(st.sampled_from(["", "@old"])) for n in names if data.draw(st.booleans())]
            for v in range(7)}
    versions = state(acks=acks, committed=committed)
    for by_member in versions.acks.values():
        for m, ack in list(by_member.items()):
            if data.draw(st.booleans()):
                by_member[m] = Ack(ack.incarnation, ack.epoch, ack.digest, "another-layout")
    spec = refit(version=7, destinations=tuple(names))
    members = view("t0", *names)
    out = with_deltas(spec, members, versions, enabled=True)
    for d in out.deltas:
        assert out.base == max(committed)
        assert holds(versions, out.base, members.member(d))
    if committed:
        assert set(out.deltas) == {d for d in names if holds(versions, max(committed), members.member(d))}
