"""Who gets a delta (DESIGN.md, "Deltas"): the coordinator's choice, pure.

A destination may be sent a version as its change against a base only when it holds exactly
that base, verified: the base is the job's latest committed version (every inference rank
held it, verified against the digests taken when it was published, when it committed), and
a destination holds it when its ack of it stands in its current incarnation and layout
(``attempt.holds``: a rank that restarted, changed its layout, or started receiving another
version since retracted or lost it). Everyone else (a joiner, a rank that missed a version,
a restarted rank) gets full bytes. Catch-ups come from holders, which hold no base: full
bytes. The choice travels with the attempt (``AttemptSpec.base`` and ``deltas``), so every
rank of the attempt plans the same exchange; a source without the base (a restarted
trainer) or a bucket whose change is not smaller sends full bytes on its own, and a
destination that finds it does not hold the base refuses the attempt before any byte moves.
Members say in their records whether they take deltas (``MemberRecord.deltas``, from
``delta_base_bytes``): an attempt with a member that does not goes in full, so a job whose
members disagree on the option still refits (in full) instead of failing attempts.
"""

from __future__ import annotations

from dataclasses import replace

from elastic_refit.membership.attempts import REFIT, AttemptSpec
from elastic_refit.membership.versions import VersionState
from elastic_refit.membership.view import MembershipView
from elastic_refit.runtime.attempt import holds

__all__ = ["with_deltas"]


def with_deltas(spec: AttemptSpec, view: MembershipView, state: VersionState, *, enabled: bool = True) -> AttemptSpec:
    """``spec`` with its delta base and the destinations that may be sent deltas (pure).
    Unchanged (no deltas) when deltas are off, when some member of the attempt does not
    take them (its record's ``deltas``: ``delta_base_bytes`` is 0 there; every sender and
    receiver must agree on the sizes exchanged before payloads), for a catch-up, when
    nothing is committed yet, or when no destination holds the latest committed version."""
    if not enabled or spec.kind != REFIT or not spec.sources:
        return replace(spec, base=None, deltas=())
    base = state.latest_committed
    if base is None or base >= spec.version or base in state.failed:
        return replace(spec, base=None, deltas=())
    members = {m.member_id: m for m in view.members}
    if not all(members[m].deltas for m in (*spec.sources, *spec.holders, *spec.destinations) if m in members):
        return replace(spec, base=None, deltas=())
    deltas = tuple(d for d in spec.destinations if d in members and holds(state, base, members[d]))
    if not deltas:
        return replace(spec, base=None, deltas=())
    return replace(spec, base=base, deltas=deltas)
