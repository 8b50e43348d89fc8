"""One rank's membership: registration on a lease, the control watch, the leader loop.

>>> m = Membership(client, job="j", record=record).start()   # doctest: +SKIP
>>> view = m.wait_for_view(lambda v: v.num_ranks == 4, timeout_s=10)   # doctest: +SKIP
>>> m.close()   # clean exit: the lease is revoked, the member key vanishes at once

A crash lets the lease expire after its TTL; the leader then publishes a new epoch.
A member that finds its lease gone (or its key taken by a newer incarnation) is *lost*:
``lost`` is set, ``on_lost`` callbacks run, and every fenced write raises
:class:`~membership.errors.MembershipLost`. It never silently re-joins.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from elastic_refit.membership.client import Compare, EtcdClient, Get, Put, TxnResult
from elastic_refit.membership.config import MembershipConfig
from elastic_refit.membership.errors import EpochTimeout, EtcdUnavailable, MembershipLost
from elastic_refit.membership.keys import JobKeys
from elastic_refit.membership.leader import LeaderLoop
from elastic_refit.membership.view import MemberRecord, MembershipView, diff
from elastic_refit.membership.watch import (
    RangeSnapshot,
    RangeWatcher,
    SharedRange,
    WatchEvent,
    WatchHub,
)

from elastic_refit.log import get_logger


class Membership:
    """Register ``record`` under job ``job`` and follow the job's epochs."""

    def __init__(self, client: EtcdClient, job: str, record: MemberRecord,
                 config: MembershipConfig | None = None, *, watch_hub: WatchHub | None = None):
        """``watch_hub``: a :class:`~membership.watch.WatchHub` of the job's control range
        shared with other members of this process (one stream for all), else a watch of
        this member's own."""
        self.client = client
        self.keys = JobKeys(job)
        self.record = record
        self.config = config or MembershipConfig()
        self.member_key = self.keys.member(record.role, record.member_id)
        self.log = get_logger(job=job, role=record.role, member_id=record.member_id,
                              incarnation=record.incarnation)
        self.lease_id = 0
        self.lost = threading.Event()
        self.lost_reason = ""
        self.closing = False
        self.is_leader = False
        self.fenced_writes = 0
        self._view: MembershipView | None = None
        self._view_cond = threading.Condition()
        self._on_view: list[Callable[[MembershipView | None, MembershipView], None]] = []
        self._on_lost: list[Callable[[str], None]] = []
        self._leader = LeaderLoop(self)
        self._last_keepalive = 0.0
        self._outage_logged = False
        self._known_members: set[str] = set()
        self._epoch_mod_revision = -1  # the epoch key's last decoded mod_revision
        start, end = self.keys.control_range
        self.watcher: RangeWatcher | SharedRange = watch_hub.view() if watch_hub is not None else RangeWatcher(
            client, start, end, name="control", progress_interval_s=self.config.progress_interval_s,
            stall_timeout_s=self.config.stall_timeout_s)

    # --------------------------------------------------------------- lifecycle
    def start(self) -> Membership:
        """Grant the lease, write the member key, start keepalive, watch and leader loop."""
        self.lease_id, granted = self.client.grant_lease(self.config.ttl_s)
        res = self.client.txn([], [Get(self.member_key),
                                   Put(self.member_key, self.record.encode(), self.lease_id)])
        self._last_keepalive = time.monotonic()
        self.log.info("membership.member.registered", lease_id=self.lease_id, ttl_s=granted,
                      revision=res.revision)
        previous = res.gets[0][0] if res.gets and res.gets[0] else None
        if previous is not None and previous.lease not in (0, self.lease_id):
            # This is a restart: the earlier incarnation is dead (or must be fenced). Ending
            # its lease now frees what it held (e.g. the leader key) without waiting its TTL.
            self.client.revoke_lease(previous.lease)
            self.log.info("membership.member.replaced", previous_lease_id=previous.lease)
        # Keepalive first: a process starting many members (or a slow first list) must not
        # let the lease run out before the watch is in place.
        self.client.spawn(self._keepalive(), name="keepalive")
        self.watcher.add_listener(self._on_change)
        self.watcher.start(revision=res.revision)
        if self.config.candidate:
            self.client.spawn(self._leader.run(), name="leader")
        return self

    def close(self) -> None:
        """Leave cleanly: stop loops and revoke the lease (member and leader keys vanish)."""
        if self.closing:
            return
        self.closing = True
        self._leader.changed_threadsafe(self.client)
        self.watcher.stop()
        if self.lease_id and not self.lost.is_set():
            with contextlib.suppress(EtcdUnavailable):
                self.client.revoke_lease(self.lease_id)
                self.log.info("membership.member.left", lease_id=self.lease_id)

    def __enter__(self) -> Membership:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------- views
    @property
    def view(self) -> MembershipView | None:
        """The latest published view (``None`` before the first epoch)."""
        with self._view_cond:
            return self._view

    @property
    def leader_token(self) -> int | None:
        """This member's fencing token while it leads, else ``None``."""
        return self._leader.token

    @property
    def last_leader_token(self) -> int | None:
        """The token of this member's latest leadership, even after losing it."""
        return self._leader.last_token

    def on_view(self, callback: Callable[[MembershipView | None, MembershipView], None]) -> None:
        """``callback(old, new)`` on every new epoch (runs on the client loop: keep it short)."""
        self._on_view.append(callback)

    def on_lost(self, callback: Callable[[str], None]) -> None:
        self._on_lost.append(callback)

    def wait_for_view(self, predicate: Callable[[MembershipView], bool] | None = None, *,
                      after_epoch: int = 0, timeout_s: float | None = None) -> MembershipView:
        """Block until a view with ``epoch > after_epoch`` satisfying ``predicate`` exists.

        Raises :class:`EpochTimeout` after ``timeout_s`` (default: the epoch deadline) and
        :class:`MembershipLost` if this member is lost meanwhile.
        """
        timeout_s = self.config.epoch_deadline_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._view_cond:
            while True:
                self.check()
                v = self._view
                if v is not None and v.epoch > after_epoch and (predicate is None or predicate(v)):
                    return v
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EpochTimeout(
                        f"no epoch > {after_epoch} matching the condition within {timeout_s}s "
                        f"(latest: {v.epoch if v else 'none'}, members "
                        f"{list(v.member_ids) if v else []})"
                    )
                self._view_cond.wait(min(left, 0.2))

    # ---------------------------------------------------------- fenced writes
    def check(self) -> None:
        """Raise :class:`MembershipLost` if this member has been lost."""
        if self.lost.is_set():
            raise MembershipLost(f"member {self.record.member_id} "
                                 f"(incarnation {self.record.incarnation}) lost: {self.lost_reason}")

    def ownership_compare(self) -> Compare:
        """Guard: my member key still exists on my lease."""
        return Compare(self.member_key, "lease", "==", self.lease_id)

    def fenced_put(self, key: str, value: bytes, *, also: Sequence[Put] = ()) -> TxnResult:
        """Write ``key`` (and the puts ``also``, in the same transaction) only while this
        member owns its key; else :class:`MembershipLost`."""
        return self._fenced(Put(key, value), "fenced write", also)

    def request_reform(self) -> None:
        """Ask the leader for a new epoch with the same members (and so a new communicator):
        this rank's communicator of the current epoch broke although nobody left."""
        self.update_record(reform=self.record.reform + 1)
        self.log.info("membership.reform.requested", reform=self.record.reform)

    def update_record(self, **changes: object) -> MemberRecord:
        """Rewrite this member's record (same lease, same incarnation), e.g. a new layout
        fingerprint; the leader publishes an epoch with it, and peers plan against it."""
        if {"role", "member_id", "incarnation"} & set(changes):
            raise ValueError(f"a member's identity cannot change, got {sorted(changes)}")
        self.record = replace(self.record, **changes)  # type: ignore[arg-type]
        self._fenced(Put(self.member_key, self.record.encode(), self.lease_id), "record update")
        return self.record

    def _fenced(self, put: Put, what: str, also: Sequence[Put] = ()) -> TxnResult:
        # Guarded only by our own lease, so a retry through an etcd outage is safe.
        res = self.client.txn([self.ownership_compare()], [put, *also], idempotent=True)
        if not res.succeeded:
            self.fenced_writes += 1
            self._mark_lost(f"{what} rejected: member key no longer on our lease")
            self.check()
        return res

    # --------------------------------------------------------------- internals
    def _mark_lost(self, reason: str) -> None:
        if self.lost.is_set() or self.closing:
            return
        self.lost_reason = reason
        self.lost.set()
        self.log.error("membership.member.lost", reason=reason, lease_id=self.lease_id)
        with self._view_cond:
            self._view_cond.notify_all()
        for cb in list(self._on_lost):
            with contextlib.suppress(Exception):
                cb(reason)
        self._leader.changed_threadsafe(self.client)

    async def _keepalive(self) -> None:
        interval = self.config.keepalive_interval
        ttl = self.config.ttl_s
        while not self.closing and not self.lost.is_set():
            await asyncio.sleep(interval)
            if self.closing:
                return
            since = time.monotonic() - self._last_keepalive
            try:
                left = await self.client.arefresh_lease(self.lease_id,
                                                        deadline_s=max(0.1, ttl - since))
            except Exception as exc:
                # etcd unreachable: keep trying. Only a reachable etcd can say the lease is
                # gone (it keeps leases across its own restarts); meanwhile every write of
                # ours is a transaction on the lease, so a lost member cannot act anyway.
                if since > ttl and not self._outage_logged:
                    self._outage_logged = True
                    self.log.warning("membership.keepalive.unreachable", seconds=round(since, 3),
                                     error=repr(exc)[:200])
                continue
            self._outage_logged = False
            if left <= 0:
                self._mark_lost(f"lease {self.lease_id} expired (last keepalive "
                                f"{time.monotonic() - self._last_keepalive:.2f}s ago)")
                return
            self._last_keepalive = time.monotonic()

    def _on_change(self, reset: bool, events: list[WatchEvent], snap: RangeSnapshot) -> None:
        # Member arrivals and departures for the timeline, from the events (a full pass over
        # the range only after a relist): O(change), not O(members), per member and change.
        if reset:
            members_now = {k for k in snap.items if self.keys.parse_member_key(k)}
            joined, gone = members_now - self._known_members, self._known_members - members_now
            self._known_members = members_now
        else:
            joined, gone = set(), set()
            for ev in events:
                if not self.keys.parse_member_key(ev.key):
                    continue
                if ev.kind == "put" and ev.key not in self._known_members:
                    self._known_members.add(ev.key)
                    joined.add(ev.key)
                elif ev.kind == "delete" and ev.key in self._known_members:
                    self._known_members.discard(ev.key)
                    gone.add(ev.key)
        for key in sorted(joined):
            self.log.info("membership.member.joined", key=key, revision=snap.revision)
        for key in sorted(gone):
            self.log.info("membership.member.gone", key=key, revision=snap.revision)
        mine = snap.items.get(self.member_key)
        if not self.closing and mine is None:
            self._mark_lost("member key deleted (lease expired or revoked)")
        elif not self.closing and mine.lease != self.lease_id:
            self._mark_lost(f"member key taken over by lease {mine.lease}")
        epoch_kv = snap.items.get(self.keys.epoch)
        if epoch_kv is not None and epoch_kv.mod_revision != self._epoch_mod_revision:
            # Decoded once per epoch write (and, through a shared watch, once per process).
            self._epoch_mod_revision = epoch_kv.mod_revision
            new = self.watcher.decoded(epoch_kv, MembershipView.decode)
            with self._view_cond:
                old = self._view
                if old is None or new.epoch > old.epoch:
                    self._view = new
                    self._view_cond.notify_all()
                else:
                    new = None
            if new is not None:
                d = diff(old, new)
                self.log.info("membership.epoch.changed", epoch=new.epoch,
                              num_members=new.num_ranks,
                              added=[m.member_id for m in d.added],
                              removed=[m.member_id for m in d.removed])
                for cb in list(self._on_view):
                    try:
                        cb(old, new)
                    except Exception:
                        self.log.exception("membership.view.callback_failed")
        self._leader.poke()

    def after_publish(self, view: MembershipView) -> None:
        """Leader hook: drop rendezvous keys of epochs no communicator can still use."""
        if view.epoch >= 3:
            old_root = self.keys.store_root

            async def _purge() -> None:
                with contextlib.suppress(Exception):
                    for e in range(max(1, view.epoch - 4), view.epoch - 1):
                        await self.client.adelete(f"{old_root}{e}/", prefix=True)

            task = asyncio.ensure_future(_purge())
            self.client._tasks.add(task)
            task.add_done_callback(self.client._tasks.discard)
