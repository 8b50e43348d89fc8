"""Pure decisions of the runtime: what moves next, and the plan for it.

Given one epoch's membership view and a snapshot of the version state, ``next_action``
says whether a version can be committed, which attempt should run, or that there is
nothing to do. ``plan_attempt`` turns an attempt into a plan over the communicator ranks of
the epoch: the sources are the live trainers that hold the version plus every inference
rank that already holds it (so a lost trainer replica is covered wherever the data still
exists), the destinations are the inference ranks that do not hold it yet.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastic_refit.layout import Layout, Topology, combine_layouts
from elastic_refit.membership.versions import VersionState
from elastic_refit.membership.view import MemberRecord, MembershipView
from elastic_refit.plan import Plan, PlanOptions, make_plan

REFIT = "refit"  # move a newly published version from the trainers
CATCH_UP = "catchup"  # bring ranks that joined or restarted to the latest committed version


@dataclass(frozen=True, slots=True)
class AttemptSpec:
    """One attempt to bring ``destinations`` to ``version`` (member ids, sorted)."""

    version: int
    kind: str
    sources: tuple[str, ...]  # trainers serving from their training layout
    holders: tuple[str, ...]  # inference ranks serving from their (complete) destination layout
    destinations: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.kind not in (REFIT, CATCH_UP):
            raise ValueError(f"attempt kind must be {REFIT!r} or {CATCH_UP!r}, got {self.kind!r}")
        if self.version < 0:
            raise ValueError(f"version must be >= 0, got {self.version}")
        if set(self.destinations) & (set(self.sources) | set(self.holders)):
            raise ValueError(f"a member cannot be source and destination: {sorted(self.destinations)}")

    @property
    def participants(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.sources) | set(self.holders) | set(self.destinations)))

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "kind": self.kind, "sources": list(self.sources),
                "holders": list(self.holders), "destinations": list(self.destinations)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AttemptSpec:
        return cls(int(data["version"]), str(data["kind"]), tuple(data["sources"]), tuple(data["holders"]),
                   tuple(data["destinations"]))


@dataclass(frozen=True, slots=True)
class CommitAction:
    """Every live inference rank holds ``version``: commit it with ``digest``."""

    version: int
    digest: str


def holds(state: VersionState, version: int, member: MemberRecord) -> bool:
    """An inference rank holds ``version`` if it acked it in its current incarnation."""
    ack = state.acks.get(version, {}).get(member.member_id)
    return ack is not None and ack.incarnation == member.incarnation


def version_digest(state: VersionState, version: int, members: tuple[MemberRecord, ...]) -> str:
    """Digest of a version as held by ``members``: their per-rank digests, in id order."""
    digest = hashlib.blake2b(digest_size=16)
    for m in sorted(members, key=lambda m: m.member_id):
        digest.update(f"{m.member_id}={state.acks[version][m.member_id].digest};".encode())
    return digest.hexdigest()


def next_action(view: MembershipView, state: VersionState,
                feasible: Callable[[AttemptSpec], bool] | None = None) -> AttemptSpec | CommitAction | None:
    """What the epoch's coordinator does next (pure).

    1. The newest published, uncommitted version newer than every committed one, once
       every live trainer has published it: commit it if every live inference rank holds
       it, else an attempt to move it. Older uncommitted versions are superseded.
    2. Otherwise, inference ranks without the latest committed version catch up from the
       inference ranks that hold it; the trainers are not involved.

    ``feasible(spec)`` (optional) says whether the live members hold every byte an attempt
    needs; an infeasible attempt is not proposed: the version waits for its holders.
    """
    feasible = feasible or (lambda spec: True)
    trainers = view.members_of("trainer")
    inference = view.members_of("inference")
    latest = state.latest_committed
    pending = [v for v, sources in state.sources.items() if sources and (latest is None or v > latest)]
    if pending:
        version = max(pending)
        published = state.sources[version]
        if trainers and all(published.get(t.member_id) == t.incarnation for t in trainers):
            holders = tuple(sorted(m.member_id for m in inference if holds(state, version, m)))
            destinations = tuple(sorted(m.member_id for m in inference if not holds(state, version, m)))
            if not inference:
                return None
            if not destinations:
                return CommitAction(version, version_digest(state, version, inference))
            sources = tuple(sorted(t.member_id for t in trainers))
            spec = AttemptSpec(version, REFIT, sources, holders, destinations)
            return spec if feasible(spec) else None
    if latest is not None and inference:
        holders = tuple(sorted(m.member_id for m in inference if holds(state, latest, m)))
        behind = tuple(sorted(m.member_id for m in inference if not holds(state, latest, m)))
        if holders and behind:
            spec = AttemptSpec(latest, CATCH_UP, (), holders, behind)
            if feasible(spec):
                return spec
    return None


def topology_of(view: MembershipView) -> Topology:
    """Communicator ranks of the epoch grouped by the domains their members reported."""
    names = sorted({m.domain for m in view.members})
    index = {name: i for i, name in enumerate(names)}
    return Topology(tuple(index[m.domain] for m in view.members), tuple(m.host for m in view.members))


def plan_attempt(source: Layout, destination: Layout, view: MembershipView, attempt: AttemptSpec,
                 options: PlanOptions | None = None) -> Plan:
    """The plan of ``attempt`` over the epoch's communicator ranks.

    ``source``/``destination`` are the full layouts in layout-rank space; members name
    their layout rank in their record. Raises ``ValueError`` when no live rank holds some
    destination region (the version cannot be completed until a holder comes back).
    """
    def ranks(member_ids: tuple[str, ...]) -> dict[int, int]:
        out = {}
        for member_id in member_ids:
            record = view.member(member_id)
            if record.layout_rank < 0:
                raise ValueError(f"member {member_id!r} has no layout rank")
            out[record.layout_rank] = view.rank_of(member_id)
        return out

    src = combine_layouts([(source, ranks(attempt.sources)), (destination, ranks(attempt.holders))])
    dst = combine_layouts([(destination, ranks(attempt.destinations))])
    return make_plan(src, dst, topology_of(view), options)
