"""Plans of attempts, memoised, and the questions the coordinator asks of them before it
proposes one: can it be planned at all, do the inference members declare the same formats,
do the sources agree where they replicate a region. Every plan comes from the pure
``plan_attempt``; this part only remembers them (its own lock) and reads layouts through
the layout cache."""

from __future__ import annotations

import threading
from collections.abc import Callable

from elastic_refit.errors import brief
from elastic_refit.layout import Layout
from elastic_refit.membership import MembershipView
from elastic_refit.membership.layouts import LayoutUnavailable
from elastic_refit.membership.versions import VersionState
from elastic_refit.plan import Plan, PlanOptions, Uncovered
from elastic_refit.runtime.attempt import (
    REFIT,
    AttemptSpec,
    format_disagreement,
    holder_cast,
    plan_attempt,
    source_layout_disagreement,
)
from elastic_refit.runtime.events import EventLog
from elastic_refit.runtime.layouts import LayoutCache
from elastic_refit.runtime.replicas import ReplicaRegion, replica_disagreement, replica_regions

__all__ = ["AttemptPlanner"]

_PLANS_KEPT = 4  # plans of big models are big
_FEASIBILITY_KEPT = 64


class AttemptPlanner:
    """Plans of attempts for one member (memoised), and what can be planned."""

    def __init__(self, layouts: LayoutCache, options: PlanOptions, log: EventLog, *, check_replicas: bool) -> None:
        self.layouts = layouts
        self.options = options
        self.check_replicas = check_replicas
        self._log = log
        self._lock = threading.Lock()
        self._plans: dict[tuple, Plan] = {}
        self._feasible: dict[tuple, bool | str] = {}  # see _verdict
        self._uncovered: dict[tuple, str] = {}  # why an infeasible attempt waits (see uncovered)
        self._regions: tuple[str, tuple[ReplicaRegion, ...]] | None = None  # (training layout, its regions)

    def plan(self, view: MembershipView, spec: AttemptSpec) -> Plan:
        """``plan_attempt`` of ``spec`` in ``view``, memoised: every refit with the same
        participants in the same places (and the coordinator's feasibility check, and
        connecting ahead) plans once. The key is what a plan reads from a view, not its
        epoch: the retry after a reform (the same members re-forming a communicator a
        timeout broke) reuses the plan instead of paying for it inside the recovery. Plans
        of other member sets are dropped."""
        members = tuple((m.role, m.member_id, m.incarnation, m.layout_rank, m.layout, m.domain, m.host)
                        for m in view.members)
        key = (members, spec.sources, spec.holders, spec.destinations, spec.layouts)
        with self._lock:
            plan = self._plans.get(key)
        if plan is None:
            plan = plan_attempt(self.layouts.layout_of, view, spec, self.options, formats_of=self.layouts.formats_of)
            with self._lock:
                for stale in [k for k in self._plans if k[0] != members]:
                    del self._plans[stale]
                while len(self._plans) >= _PLANS_KEPT:
                    self._plans.pop(next(iter(self._plans)))
                self._plans[key] = plan
        return plan

    def feasible(self, view: MembershipView, spec: AttemptSpec) -> bool:
        """Whether live members hold every byte ``spec`` needs (memoised per epoch). A refit
        that can never be planned with these members counts as feasible: the coordinator
        refuses its version (:meth:`disagreement` says why) instead of waiting for it."""
        verdict = self._verdict(view, spec)
        return verdict is True or (isinstance(verdict, str) and spec.kind == REFIT)

    def unplannable(self, view: MembershipView, spec: AttemptSpec) -> str | None:
        """Why ``spec`` can never be planned with these members and layouts (inference
        members that declare different formats, layouts whose tensors differ in name, shape
        or dtype, two members claiming one layout rank, a bucket too small), or None (it can,
        or it waits for a member or a layout to come)."""
        verdict = self._verdict(view, spec)
        return verdict if isinstance(verdict, str) else None

    def uncovered(self, view: MembershipView, spec: AttemptSpec) -> str | None:
        """Why ``spec`` waits: a region no participant holds (the planner's ``Uncovered``),
        or None (it can be planned, or not yet for another reason)."""
        if spec.holders and self._verdict(view, spec) is False:
            return self._uncovered.get((view.epoch, spec))
        return None if spec.holders else f"no live inference rank holds version {spec.version}"

    def _verdict(self, view: MembershipView, spec: AttemptSpec) -> bool | str:
        """True: plannable; False: not yet (a layout not in etcd, a region no live member
        holds); a string: never, with these members (why)."""
        if spec.kind != REFIT and not spec.holders and not spec.sources:
            return False  # nobody to catch up from (yet): not a fault of the layouts (see uncovered)
        where = self.format_disagreement(view, spec)
        if where is not None:
            return where
        key = (view.epoch, spec)
        if key not in self._feasible:
            try:
                self.plan(view, spec)
                self._feasible[key] = True
            except LayoutUnavailable as exc:  # not published yet, or gone: ask again next time
                self._log.warning("refit.layout.unavailable", version=spec.version, epoch=view.epoch,
                                  reason=brief(exc))
                return False
            except Uncovered as exc:  # a member holding the region is gone: wait for it
                self._feasible[key] = False
                self._uncovered[key] = brief(exc)
                self._log.warning("refit.version.unavailable", version=spec.version, kind=spec.kind,
                                  epoch=view.epoch, reason=brief(exc))
            except ValueError as exc:  # the layouts or the settings: no retry can plan it
                self._feasible[key] = brief(exc)
                self._log.error("refit.version.unplannable", version=spec.version, kind=spec.kind,
                                epoch=view.epoch, reason=brief(exc))
            if len(self._feasible) > _FEASIBILITY_KEPT:
                self._uncovered.pop(next(iter(self._feasible)), None)
                self._feasible.pop(next(iter(self._feasible)))
        return self._feasible.get(key, False)

    def format_disagreement(self, view: MembershipView, spec: AttemptSpec) -> str | None:
        """Why the attempt's inference members cannot be planned together (they declare
        different destination formats), or None; None too while a description is not in
        etcd yet (the feasibility check waits for it)."""
        try:
            return format_disagreement(self.layouts.formats_of, view, spec)
        except LayoutUnavailable:
            return None

    def disagreement(self, view: MembershipView, state: VersionState, spec: AttemptSpec) -> str | None:
        """Why a new version is refused before any attempt: it can never be planned with
        these members (:meth:`unplannable`), or (``check_replicas``) sources that disagree."""
        where = self.unplannable(view, spec)
        if where is None and self.check_replicas:
            where = self._replica_disagreement(view, state, spec)
        return where

    def holders_serve(self, view: MembershipView, spec: AttemptSpec) -> bool:
        """Whether the holders of a refit can send beside its trainers: not when they hold
        a quantized destination format, or other dtypes than the trainers (``holder_cast``;
        they then receive the version again)."""
        try:
            return (not any(self.layouts.formats_of(view.member(m), spec.layout(m)) for m in spec.holders)
                    and holder_cast(self.layouts.layout_of, view, spec) is None)
        except LayoutUnavailable:
            return True  # the feasibility check waits for the description

    def replica_regions(self, layout: Layout) -> tuple[ReplicaRegion, ...]:
        """The replica regions of training layout ``layout`` (memoised for the latest one)."""
        if self._regions is None or self._regions[0] != layout.fingerprint:
            self._regions = (layout.fingerprint, replica_regions(layout))
        return self._regions[1]

    def _replica_disagreement(self, view: MembershipView, state: VersionState, spec: AttemptSpec) -> str | None:
        """Where the attempt's sources, as published, differ on a region they share (or on
        the layout they published it in)."""
        disagreement = source_layout_disagreement(spec)
        if disagreement is not None or not spec.sources:
            return disagreement
        first = spec.sources[0]
        regions = self.replica_regions(self.layouts.layout_of(view.member(first), spec.layout(first)))
        if not regions:
            return None
        published = state.source_regions.get(spec.version, {})
        ranks = {view.member(m).layout_rank: m for m in spec.sources}
        digests = {rank: published[m] for rank, m in ranks.items() if m in published}
        return replica_disagreement(regions, digests, ranks)


def coordinator_checks(planner: AttemptPlanner, view: MembershipView,
                       state: VersionState) -> dict[str, Callable[[AttemptSpec], object]]:
    """The questions ``coordinate`` asks, bound to ``view`` and ``state``."""
    return {"feasible": lambda spec: planner.feasible(view, spec),
            "disagreement": lambda spec: planner.disagreement(view, state, spec),
            "holders_serve": lambda spec: planner.holders_serve(view, spec)}
