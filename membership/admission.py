"""When the leader admits an inference newcomer: a pure decision (the clock passed in).

A newcomer in the next epoch makes that epoch a grow, and a version is committed only once
every inference rank of the epoch holds it. An inference rank that registers while a version
is on its way (a recovery's first refit above all: a rank killed, the epoch shrunk, the
version re-sent) would make that commit wait for the grow and for the newcomer's own refit:
measured on NCCL, 0.7-1.0 s added to a 0.2 s recovery. So the leader holds an inference
newcomer out of the epoch while the version that was pending when it was first seen is
neither committed nor failed, for at most ``MembershipConfig.join_hold_s``; it then joins
with a grow and catches up as any newcomer does. Trainers are never held (a pending version
may need the bytes only a returning trainer has), nor a newcomer whose shard no inference
rank of the epoch holds (``MemberRecord.shard``: after the commit it could only catch up
from the trainers' next version, since catch-ups come from holders; so nobody is held when
the epoch has no inference rank). torchft's quorum makes the same trade: a healthy quorum
goes on without waiting for joiners, who come in at the next one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from elastic_refit.membership.view import MemberRecord, MembershipView


class VersionState(Protocol):
    """What admission reads of the job's versions (``membership.versions.VersionState``;
    named here, not imported: that module imports the service, which imports the leader)."""

    sources: Mapping[int, Any]
    committed: Mapping[int, Any]
    failed: Mapping[int, Any]

    @property
    def latest_committed(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class Sighting:
    """A newcomer as the leader first saw it: when (monotonic seconds) and the version
    pending then (None: none, so nothing to wait for)."""

    first_seen: float
    waits_for: int | None


@dataclass(frozen=True, slots=True)
class Admission:
    """The next epoch's members with the held newcomers left out, who is held, and how long
    until the soonest hold runs out (0: nobody held)."""

    members: tuple[MemberRecord, ...]
    held: tuple[str, ...]
    hold_s: float
    why: str


def pending_version(state: VersionState) -> int | None:
    """The newest version some trainer published that is neither committed nor failed and
    is newer than the latest commit, else None."""
    floor = state.latest_committed or 0
    open_versions = [v for v in state.sources if v > floor and v not in state.committed and v not in state.failed]
    return max(open_versions, default=None)


def settled(version: int, state: VersionState) -> bool:
    """Whether ``version`` no longer stands in a newcomer's way: committed (or a later one
    is), failed, or gone from etcd (pruned, or never published)."""
    latest = state.latest_committed
    return ((latest is not None and latest >= version) or version in state.failed
            or version not in state.sources)


def admit(now: float, current: MembershipView | None, desired: tuple[MemberRecord, ...],
          sightings: Mapping[tuple[str, str, str], Sighting], state: VersionState, *, hold_bound_s: float) -> Admission:
    """Which of ``desired`` (the next member order) go into the next epoch now.

    ``sightings``: every inference newcomer of ``desired`` (by ``identity``), as first seen.
    A newcomer is held while its sighting's version is not ``settled`` and for at most
    ``hold_bound_s`` since it was seen, and only if an inference rank of ``current`` holds
    its shard (it catches up from that one)."""
    if current is None or hold_bound_s <= 0:
        return Admission(desired, (), 0.0, "no epoch yet" if current is None else "holding is off")
    known = {m.identity for m in current.members}
    shards = {m.shard for m in current.members if m.role == "inference" and m.shard}
    members, held, hold_s, reasons = [], [], float("inf"), []
    for m in desired:
        sighting = sightings.get(m.identity)
        if (m.identity in known or m.role != "inference" or m.shard not in shards or sighting is None
                or sighting.waits_for is None):
            members.append(m)
            continue
        left = sighting.first_seen + hold_bound_s - now
        if left <= 0 or settled(sighting.waits_for, state):
            members.append(m)
            continue
        held.append(m.member_id)
        hold_s = min(hold_s, left)
        reasons.append(f"{m.member_id} waits for version {sighting.waits_for}")
    if not held:
        return Admission(tuple(members), (), 0.0, "no newcomer waits")
    return Admission(tuple(members), tuple(held), hold_s, "; ".join(reasons))
