"""A live member whose lease was lost comes back as a new incarnation, in its process.

Its lease expired (etcd stalled past the TTL, a GC pause, a loaded host) or the leader fenced
it as a suspect: nothing of the old incarnation can write any more (every member write
compares the member key's lease, and that lease is gone). As etcd's own clients and
Kubernetes controllers do, the member registers again under a new incarnation, with backoff
while etcd is unreachable, republishes its layout, and a trainer names itself again as the
source of the versions it holds and the job has not settled yet; the agent starts over in no
epoch. An inference rank keeps its buffers: its acks are the old incarnation's, so it
receives the latest version again (``next_action``: it does not hold it). Another process
holding the member key (a second member with the same id, or this member restarted
elsewhere) is not a loss to come back from: the agent fails then (``Driver._may_rejoin``);
nor is a job whose control state was replaced (etcd wiped or restored from another state:
its run instance changed, ``JobStateLost``), where going on could serve versions out of order.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

from elastic_refit.errors import MembershipLost, brief
from elastic_refit.membership import (
    CommunicatorManager,
    EtcdClient,
    IdentityClash,
    JobStateLost,
    MemberRecord,
    Membership,
    RunClash,
)
from elastic_refit.membership.errors import JOB_STATE_LOST_ADVICE
from elastic_refit.runtime.checks import Side
from elastic_refit.runtime.config import RefitConfig
from elastic_refit.runtime.outcomes import Outcomes
from elastic_refit.runtime.published import PublishedVersions
from elastic_refit.runtime.services import Services

__all__ = ["BACKOFF_S", "Detachment", "communicator_manager", "out_of_touch", "register", "rejoin"]

BACKOFF_S = (0.25, 0.5, 1.0, 2.0, 4.0)  # between tries while etcd is unreachable; then the last, again


def communicator_manager(client: EtcdClient, config: RefitConfig, membership: Membership) -> CommunicatorManager:
    """The communicators of ``membership``'s epochs (see ``CommunicatorManager``)."""
    c = config

    def superseded(epoch: int) -> bool:
        latest = membership.view
        return latest is not None and latest.epoch > epoch

    return CommunicatorManager(
        client, c.job, c.member_id, backend=c.backend, config=membership.config, superseded=superseded,
        latest_view=lambda: membership.view, transport_timeout_s=c.transport_timeout_s, device=c.device,
        bind_interface=c.transfer.bind_interface,
        direct_reads_device=c.device if c.transfer.same_host == "ipc" else None)


def register(services: Services, config: RefitConfig, side: Side) -> Membership:
    """Register ``config``'s incarnation (a new lease and member key, naming ``services``'
    incarnation as the one it comes back from), publish ``side``'s layout and wake the
    agent on every view and on a loss; retried with backoff
    (:data:`BACKOFF_S`) until it succeeds or the member closes (``MembershipLost``)."""
    c = config
    record = MemberRecord(c.role, c.member_id, c.incarnation, c.host, c.domain, c.device,
                          layout_rank=c.layout_rank, layout=side.described,
                          deltas=c.transfer.delta_base_bytes > 0, rejoined_from=services.config.incarnation,
                          rejoins=services.membership.record.rejoins + 1, shard=side.shard)
    for tries in range(1, 1 << 30):
        if services.stop.is_set():
            raise MembershipLost(f"{c.member_id}: closing while it registered again")
        membership = Membership(services.client, c.job, record, c.membership_config())
        try:
            try:
                membership.start()
            except RunClash as exc:  # another run holds the job's name now: not the one it joined
                raise JobStateLost(_state_replaced(services.membership, brief(exc))) from exc
            _check_same_run(membership, services.membership)
            services.layouts.publish(membership, side.layout, side.formats)
        except JobStateLost:
            with contextlib.suppress(Exception):
                membership.close()  # never a member of a job whose state is not the one it joined
            raise
        except IdentityClash as exc:
            raise MembershipLost(f"{c.member_id} cannot register again: {brief(exc)}") from exc
        except Exception as exc:  # etcd unreachable, its lease lost again: try again
            with contextlib.suppress(Exception):
                membership.close()
            wait_s = BACKOFF_S[min(tries, len(BACKOFF_S)) - 1]
            services.log.warning("refit.member.rejoin_failed", tries=tries, retry_in_s=wait_s, error=brief(exc))
            services.stop.wait(wait_s)
            continue
        membership.on_view(lambda _old, _new: services.changes.bump())
        membership.on_lost(lambda _reason: services.changes.bump())
        services.tracker.on_change(membership.hold_newcomers_for(services.tracker.state))
        return membership
    raise AssertionError("unreachable")


def out_of_touch(services: Services) -> str | None:
    """Why ``services``' member is out of the job although nobody said so yet: no keepalive
    of its lease answered for longer than the TTL (etcd stalled or unreachable); None if
    one was."""
    silent_s, ttl_s = services.membership.lease_silent_s(), services.config.ttl_s
    if silent_s <= ttl_s:
        return None
    return f"no keepalive of its lease answered for {silent_s:.1f} s (TTL {ttl_s} s): etcd is stalled or unreachable"


class Detachment:
    """Whether a member is out of the job, and its way back: what ``ElasticRefit.detached``
    says, where ``weights()`` under ``serve_when_detached='block'`` waits. Waiters are woken
    (``outcomes.changed``) whenever it may have ended: the member rejoined, or etcd answered
    its lease's keepalive again after being silent past the TTL (the lease lived)."""

    def __init__(self, outcomes: Outcomes) -> None:
        self._outcomes = outcomes
        self._services: Services | None = None
        self._rejoining: str | None = None  # why, while the member registers again

    def follow(self, services: Services) -> None:
        """``services`` are the member's now (at start, and after each rejoin)."""
        self._services = services
        services.membership.on_back(self._outcomes.changed)

    @property
    def rejoining(self) -> bool:
        return self._rejoining is not None

    def why(self) -> str | None:
        """Why the member is out of the job (its lease was lost and it registers again, or
        etcd answers none of its keepalives), or None."""
        if self._rejoining is not None:
            return self._rejoining
        return out_of_touch(self._services) if self._services is not None else None

    def come_back(self, side: Side, published: PublishedVersions | None, reason: str) -> Services:
        """The services of the member's new incarnation (:func:`rejoin`), out of the job
        meanwhile for ``reason``."""
        self._rejoining = reason
        self._outcomes.changed()
        services = rejoin(self._services, side, published, reason)  # raised: out for good (the agent latches it)
        self.follow(services)
        self._rejoining = None
        self._outcomes.changed()
        return services


def _check_same_run(membership: Membership, joined: Membership) -> None:
    """``JobStateLost`` unless the job's run is still the one ``joined`` (this member's
    previous membership) joined: a wiped etcd has none (the new registration just created
    one: a new instance, under the same run id if the run has an explicit one), an etcd
    restored from another run's state another."""
    if joined.run_instance and membership.run_instance != joined.run_instance:
        since = f", started {membership.run_started}" if membership.run_started else ""
        raise JobStateLost(_state_replaced(joined, f"now run {membership.run_id} instance "
                                                   f"{membership.run_instance}{since}"))


def _state_replaced(joined: Membership, now: str) -> str:
    return (f"{joined.record.member_id}: the job's control state in etcd is not the one it joined (run "
            f"{joined.run_id} instance {joined.run_instance}; {now}): etcd was wiped or restored from another "
            "state; " + JOB_STATE_LOST_ADVICE)


def rejoin(services: Services, side: Side, published: PublishedVersions | None, reason: str, *,
           clock: Callable[[], float] = time.monotonic) -> Services:
    """The services of a new incarnation of ``services``' member, which lost its lease for
    ``reason``: the old membership and communicators are closed first (nothing of them can
    write), the new one registered (:func:`register`), and a trainer's unsettled versions
    (``published``) sourced again under it."""
    t0 = clock()
    old = services.config
    for close in (services.manager.close, services.membership.close):
        with contextlib.suppress(Exception):  # the old incarnation is gone either way
            close()
    config = replace(old, incarnation=uuid.uuid4().hex[:12])
    log = services.log.bind(incarnation=config.incarnation)
    membership = register(replace(services, log=log), config, side)
    fresh = replace(services, config=config, membership=membership, log=log,
                    manager=communicator_manager(services.client, config, membership))
    versions = _source_again(fresh, published, old.incarnation) if published is not None else []
    log.info("refit.member.rejoined", previous_incarnation=old.incarnation, reason=reason,
             seconds=round(clock() - t0, 3), versions_sourced=versions)
    return fresh


def _source_again(services: Services, published: PublishedVersions, previous: str) -> list[int]:
    """Name this trainer again as the source of every version it still holds and the
    lost incarnation ``previous`` had announced, unless the version is settled (committed
    or failed): its digests, regions and layout as announced then."""
    state = services.tracker.state()
    me = services.config.member_id
    again = []
    for version in published.in_flight():
        if (state.sources.get(version, {}).get(me) != previous or version in state.committed
                or version in state.failed):
            continue
        services.versions.publish_source(services.membership, version, state.source_digests.get(version, {}).get(me, ""),
                                         state.source_regions.get(version, {}).get(me),
                                         state.source_layouts.get(version, {}).get(me, ""))
        again.append(version)
    return again
