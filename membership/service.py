"""One rank's membership: registration on a lease, the control watch, the leader loop.

>>> m = Membership(client, job="j", record=record).start()   # doctest: +SKIP
>>> view = m.wait_for_view(lambda v: v.num_ranks == 4, timeout_s=10)   # doctest: +SKIP
>>> m.close()   # clean exit: the lease is revoked, the member key vanishes at once

A crash is confirmed without waiting for the lease (``membership/liveness.py``): a ring
neighbour or a transfer peer reports a suspicion, the suspect refutes it if alive, and an
unrefuted suspect is fenced and dropped from the next epoch at once. A stopped or hung
process keeps its lease TTL as its bound: the lease expires and the leader publishes a
new epoch.
A member that finds its lease gone (or its key taken by a newer incarnation) is *lost*:
``lost`` is set, ``on_lost`` callbacks run, and every fenced write raises
:class:`~membership.errors.MembershipLost`. It never silently re-joins: a new
``Membership`` under a new incarnation may (the runtime does, unless ``replaced``: another
process holds the member's key).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from elastic_refit.membership.admission import VersionState
from elastic_refit.membership.client import Compare, Delete, EtcdClient, Get, Put, TxnResult
from elastic_refit.membership.config import MembershipConfig
from elastic_refit.membership.errors import (
    EpochTimeout,
    EtcdUnavailable,
    IdentityClash,
    JobStateLost,
    MembershipLost,
)
from elastic_refit.membership.index import ControlIndex, control_index
from elastic_refit.membership.keys import ROLES, JobKeys
from elastic_refit.membership.leader import LeaderLoop
from elastic_refit.membership.leases import lease_keeper
from elastic_refit.membership.liveness import (
    LivenessRing,
    RingPeer,
    Suspicion,
    dead_peer_evidence,
    decide_suspicions,
    probe_dead,
    reachable_probe,
    ring_order,
    ring_successor_in,
)
from elastic_refit.membership.run import job_run
from elastic_refit.membership.view import MemberRecord, MembershipView, diff
from elastic_refit.membership.watch import (
    RangeSnapshot,
    RangeWatcher,
    SharedRange,
    WatchEvent,
    WatchHub,
)

from elastic_refit.errors import brief
from elastic_refit.log import get_logger

_LOGGED_IDS = 16  # member ids named in one epoch-change log event


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
        self.replaced = False  # lost because another lease took the member key over (see _taken_over)
        # Lost because etcd answered below a revision this process saw (membership.revisions):
        # the job's state went back, and no new incarnation may join it.
        self.state_lost: JobStateLost | None = None
        self._unguard: Callable[[], None] = lambda: None
        self.run_id = ""  # the job's run id when this member registered (see membership.run)
        self.run_instance = ""  # ... and its instance: a wiped etcd may recreate the id, never this
        self.run_started = ""  # ... and when the run's key was created (UTC, ISO 8601)
        self.closing = False
        self.is_leader = False
        self.fenced_writes = 0
        self._view: MembershipView | None = None
        self._view_cond = threading.Condition()
        self._on_view: list[Callable[[MembershipView | None, MembershipView], None]] = []
        self._on_lost: list[Callable[[str], None]] = []
        self._on_back: list[Callable[[], None]] = []
        self._leader = LeaderLoop(self)
        self._keeper = None  # the LeaseKeeper renewing our lease, from start() on
        self._known_members: set[str] = set()
        self._epoch_mod_revision = -1  # the epoch key's last decoded mod_revision
        self._ring: LivenessRing | None = None
        self._suspicions_changed: asyncio.Event | None = None  # made on the loop
        self._suspicions_seen: dict[tuple[str, int], float] = {}
        self._suspicions_acting: set[tuple[str, int]] = set()  # refute/confirm in flight
        self._suspicions_checked: set[tuple[str, int]] = set()  # our own evidence check started
        self._suspicions_verified: set[tuple[str, int]] = set()  # ... and found the suspect dead
        # Reports that found another reporter's suspicion in place: raised again if that one
        # vanishes (its reporter died too) while the suspect's key is still on that lease.
        self._pending_reports: dict[str, tuple[int, str, str]] = {}
        self.suspicions_reported = 0
        self.suspicions_refuted = 0
        self.suspicions_confirmed = 0
        start, end = self.keys.control_range
        self.watcher: RangeWatcher | SharedRange = watch_hub.view() if watch_hub is not None else RangeWatcher(
            client, start, end, name="control", progress_interval_s=self.config.progress_interval_s,
            stall_timeout_s=self.config.stall_timeout_s)

    # --------------------------------------------------------------- lifecycle
    def start(self) -> Membership:
        """Grant the lease, write the member key, start keepalive, watch and leader loop."""
        asked = time.monotonic()  # the lease runs from (at the latest) the grant request
        self.lease_id, granted = self.client.grant_lease(self.config.ttl_s)
        # Kept alive from the grant on, before anything else: at a thousand members joining
        # at once the registration below can take longer than the TTL, and a lease whose
        # first keepalive waited for it expired before its member ever registered.
        self._keeper = lease_keeper(self.client)
        self._keeper.keep(self.lease_id, ttl_s=self.config.ttl_s, interval_s=self.config.keepalive_interval,
                          on_lost=self._lease_lost_threadsafe, renewed_at=asked, on_back=self._lease_back)
        try:
            if self.config.liveness_host is not None:
                # Listening before registering: a peer that finds the probe in the record can
                # connect, and a refused connect then always means this process is gone.
                self._ring = LivenessRing(self.config.liveness_host, self.record.member_id, self.lease_id,
                                          self.record.incarnation, self._on_ring_death, self.log)
                probe = self.client.run(self._ring.start(), timeout_s=10)
                self.record = replace(self.record, probe=probe)
            # Not under an id a live member of the other role holds (a restart of this
            # role's member takes its key over, see below; two roles cannot share an id).
            # The job's run, created if this is its first member; RunClash (before the
            # member key is written) if it is another run than the one configured.
            run = job_run(self.client, self.keys, self.config.run_id)
            self.run_id, self.run_instance, self.run_started = run.run_id, run.instance, run.started
            others = [self.keys.member(r, self.record.member_id) for r in ROLES if r != self.record.role]
            res = self.client.txn([Compare(k, "create", "==", 0) for k in others],
                                  [Get(self.member_key), Put(self.member_key, self.record.encode(), self.lease_id)],
                                  [Get(k) for k in others])
            if not res.succeeded:
                raise IdentityClash(self._clash(res))
        except BaseException:
            # Not a member: neither the lease nor the ring's listener may outlive the call.
            self._keeper.release(self.lease_id)
            with contextlib.suppress(Exception):
                self.client.revoke_lease(self.lease_id)
            if self._ring is not None:
                with contextlib.suppress(Exception):
                    self.client.run(self._ring.aclose(), timeout_s=3)
            raise
        self.log.info("membership.member.registered", lease_id=self.lease_id, ttl_s=granted,
                      revision=res.revision)
        previous = res.gets[0][0] if res.gets and res.gets[0] else None
        if previous is not None and previous.lease not in (0, self.lease_id):
            # This is a restart: the earlier incarnation is dead (or must be fenced). Ending
            # its lease now frees what it held (e.g. the leader key) without waiting its TTL.
            self.client.revoke_lease(previous.lease)
            self.log.info("membership.member.replaced", previous_lease_id=previous.lease)
        self.watcher.add_listener(self._on_change)
        if self.client.revisions is not None:  # etcd restored from an older state: lost for good
            self._unguard = self.client.revisions.on_went_back(self._went_back)
        self.client.spawn(self._suspicion_loop(), name="suspicions")
        self.watcher.start(revision=res.revision)
        if self.config.candidate:
            self.client.spawn(self._leader.run(), name="leader")
        return self

    def _clash(self, res: TxnResult) -> str:
        holder = next((kvs[0] for kvs in res.gets if kvs), None)
        who = ""
        if holder is not None:
            with contextlib.suppress(ValueError, KeyError):
                other = MemberRecord.decode(holder.value)
                who = f" (incarnation {other.incarnation} on host {other.host})"
        return (f"member_id {self.record.member_id!r} is already registered in job {self.keys.job!r} by a member "
                f"of the other role{who}: every member of a job needs its own member_id")

    def close(self) -> None:
        """Leave cleanly: stop loops and revoke the lease (member and leader keys vanish)."""
        if self.closing:
            return
        self.closing = True
        self._unguard()
        try:
            self._leader.changed_threadsafe(self.client)
            self.watcher.stop()
            silent = None  # the longest wait for a keepalive answer: how close the lease came to its TTL
            if self._keeper is not None:
                silent = self._keeper.max_silent_s(self.lease_id)
                self._keeper.release(self.lease_id)
            if self.lease_id and not self.lost.is_set():
                with contextlib.suppress(EtcdUnavailable):
                    self.client.revoke_lease(self.lease_id)
                    self.log.info("membership.member.left", lease_id=self.lease_id,
                                  max_keepalive_silence_s=None if silent is None else round(silent, 3))
            self._poke_suspicions_threadsafe()
        finally:
            if self._ring is not None:
                # After the revoke: our ring neighbours' connections end with a goodbye, and
                # any report of a goodbye-less end no longer matches a member key anyway.
                # Whatever failed above, the ring's sockets must not outlive the member.
                with contextlib.suppress(Exception):
                    self.client.run(self._ring.aclose(), timeout_s=3)

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

    def hold_newcomers_for(self, versions: Callable[[], VersionState]) -> Callable[..., None]:
        """While this member leads, hold inference newcomers out of the next epoch as long as
        the version pending at their arrival is on its way (``membership.admission``, at most
        ``config.join_hold_s``). ``versions``: the job's version state (a tracker's ``state``);
        returns the callback to call when that state changes (any thread, any arguments)."""
        return self._leader.hold_newcomers_for(versions, self.client)

    def on_view(self, callback: Callable[[MembershipView | None, MembershipView], None]) -> None:
        """``callback(old, new)`` on every new epoch (runs on the client loop: keep it short)."""
        self._on_view.append(callback)

    def on_lost(self, callback: Callable[[str], None]) -> None:
        self._on_lost.append(callback)

    def on_back(self, callback: Callable[[], None]) -> None:
        """``callback()`` when etcd answers a keepalive of this member's lease after none was
        answered for longer than the TTL (``lease_silent_s`` falls back under it and the lease
        lives; runs on the keeper's thread: keep it short)."""
        self._on_back.append(callback)

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
    def lease_silent_s(self) -> float:
        """Seconds since etcd last answered a keepalive of this member's lease (0.0 while
        unknown): past the TTL, the lease may be gone without etcd having said so yet."""
        renewed = self._keeper.renewed_at(self.lease_id) if self._keeper is not None else None
        return 0.0 if renewed is None else max(0.0, time.monotonic() - renewed)

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
        latest = self.view
        self.update_record(reform=self.record.reform + 1, reform_epoch=latest.epoch if latest else 0)
        self.log.info("membership.reform.requested", reform=self.record.reform)

    def report_peer_failure(self, member_id: str, incarnation: str, message: str) -> bool:
        """A transfer with ``member_id`` (incarnation ``incarnation``) failed with
        ``message``: if that is evidence of the peer's death (reset, closed, refused, NCCL's
        remote exit; never a timeout), report a suspicion of it. Returns whether one is
        reported; never blocks (the report is a transaction on the client loop)."""
        evidence = dead_peer_evidence(message)
        if evidence is None or self.closing or self.lost.is_set() or member_id == self.record.member_id:
            return False
        self.client.loop.call_soon_threadsafe(
            self.client.spawn_here, self.asuspect(member_id, evidence, brief(message),
                                            incarnation=incarnation), "suspect")
        return True

    async def asuspect(self, member_id: str, evidence: str, detail: str = "", *, lease: int | None = None,
                       incarnation: str | None = None) -> bool:
        """Report a suspicion that ``member_id`` died (on this member's lease, so it goes
        with us). It names the suspect's lease as the snapshot shows it (or ``lease``,
        when the evidence is about a known lease): a suspicion about an incarnation that is
        gone already is not written. Returns whether this call created it (False: not a
        member any more, already suspected, or we are not a member)."""
        if self.closing or self.lost.is_set():
            return False
        found = self.index(self.watcher.snapshot()).members.get(member_id)
        if found is None:
            return False
        member_key, kv = found
        role = self.keys.parse_member_key(member_key)[0]  # type: ignore[index]
        if lease is not None and kv.lease != lease:
            return False  # that incarnation is gone already
        try:
            record = MemberRecord.decode(kv.value)
        except (ValueError, KeyError):
            return False
        if incarnation is not None and record.incarnation != incarnation:
            return False
        if record.probe and reachable_probe(record.probe, record.host, self.record.host):
            # Evidence checked before it is reported: a connection that failed because the
            # peer aborted it, or one that ended while the process lives on, is no death.
            verdict = await probe_dead(record.probe)
            if verdict is None:
                self.log.info("membership.suspect.dismissed", suspect=member_id, evidence=evidence,
                              detail=detail[:200])
                return False
            detail = f"{detail[:200]}; its listener: {verdict}"
            if self.closing or self.lost.is_set():
                return False
        suspicion = Suspicion(member_id, role, kv.lease, record.incarnation, self.record.member_id,
                              self.lease_id, evidence, detail)
        key = self.keys.suspect(member_id)
        try:
            res = await self.client.atxn(
                [Compare(key, "create", "==", 0), Compare(member_key, "lease", "==", kv.lease),
                 self.ownership_compare()],
                [Put(key, suspicion.encode(), self.lease_id)])
        except Exception as exc:  # etcd trouble: the TTL stays the bound
            self.log.warning("membership.suspect.report_failed", suspect=member_id, error=repr(exc)[:200])
            return False
        if not res.succeeded:
            self._pending_reports[member_id] = (kv.lease, evidence, detail)
        else:
            self._pending_reports.pop(member_id, None)
            self.suspicions_reported += 1
            self.log.info("membership.suspect.reported", suspect=member_id, suspect_lease=kv.lease,
                          evidence=evidence, detail=detail[:200], revision=res.revision)
        return res.succeeded

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
        if self._keeper is not None:
            self._keeper.release(self.lease_id)
        self.log.error("membership.member.lost", reason=reason, lease_id=self.lease_id)
        with self._view_cond:
            self._view_cond.notify_all()
        for cb in list(self._on_lost):
            with contextlib.suppress(Exception):
                cb(reason)
        self._leader.changed_threadsafe(self.client)

    def _taken_over(self, mine) -> str:
        """Why this member is lost when another lease holds its key: who holds it."""
        who = f"lease {mine.lease}"
        with contextlib.suppress(ValueError, KeyError):
            other = MemberRecord.decode(mine.value)
            who = f"incarnation {other.incarnation} on host {other.host} (lease {mine.lease})"
        return (f"member key taken over by {who}: this member restarted elsewhere, or another process runs "
                f"with member_id {self.record.member_id!r}")

    def _poke_suspicions(self) -> None:
        if self._suspicions_changed is not None:
            self._suspicions_changed.set()

    def _poke_suspicions_threadsafe(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed already
            self.client.loop.call_soon_threadsafe(self._poke_suspicions)

    def _on_ring_death(self, member_id: str, lease: int, evidence: str, detail: str) -> None:
        """The ring saw ``member_id``'s connection end without a goodbye (loop thread)."""
        if not self.closing and not self.lost.is_set():
            self.client.spawn_here(self.asuspect(member_id, evidence, detail, lease=lease), "suspect")

    def index(self, snap: RangeSnapshot) -> ControlIndex:
        """The :class:`ControlIndex` of ``snap`` (one of this member's watcher's snapshots),
        built once per snapshot for every member sharing the watch."""
        return self.watcher.derived("control-index", snap, lambda s: control_index(self.keys, s))

    def _update_ring(self, snap: RangeSnapshot) -> None:
        if self._ring is None or self.closing or self.lost.is_set():
            return
        host = self.record.host

        def order(s: RangeSnapshot):
            peers = []
            for key, kv in self.index(s).members.values():
                with contextlib.suppress(ValueError, KeyError):
                    record = self.watcher.decoded(kv, MemberRecord.decode)  # once per record write, per process
                    if record.probe:
                        peers.append(RingPeer(key, record.member_id, kv.lease, record.probe, record.host))
            return ring_order(peers, host)

        # The ring of this host, sorted once per snapshot for every member of the process.
        self._ring.follow(ring_successor_in(self.member_key, self.watcher.derived(f"ring:{host}", snap, order)))

    async def _suspicion_loop(self) -> None:
        """Refute suspicions of ourselves; confirm (fence) or drop the ones we confirm.
        Woken by control changes and by the end of a pending window."""
        self._suspicions_changed = asyncio.Event()
        wake: float | None = None
        while not self.closing and not self.lost.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._suspicions_changed.wait(), wake)
            self._suspicions_changed.clear()
            if self.closing or self.lost.is_set():
                return
            snap = self.watcher.snapshot()
            index = self.index(snap)
            leases = index.member_leases
            leader = index.leader
            decision = decide_suspicions(
                time.monotonic(), index.suspicions, self._suspicions_seen, my_lease=self.lease_id,
                member_leases=leases, leader_lease=leader.lease if leader is not None else None,
                refute_window_s=self.config.refute_window_s, verified=frozenset(self._suspicions_verified))
            self._suspicions_seen = dict(decision.seen or {})
            live = set(self._suspicions_seen)
            self._suspicions_checked &= live
            self._suspicions_verified &= live
            for s in decision.pending:
                if (s.suspect, s.revision) not in self._suspicions_checked:
                    self._suspicions_checked.add((s.suspect, s.revision))
                    self.client.spawn_here(self._check_evidence(s, snap), "suspicion-check")
            wake = decision.wake_in_s
            for s in decision.refute:
                self._act(s, self._refute(s))
            for s in decision.confirm:
                self._act(s, self._confirm(s, leader))
            for s in decision.drop:
                self._act(s, self._drop(s))
            self._retry_reports(snap, leases)

    def _retry_reports(self, snap: RangeSnapshot, leases: Mapping[str, int]) -> None:
        for member_id, (lease, evidence, detail) in list(self._pending_reports.items()):
            if leases.get(member_id) != lease:
                del self._pending_reports[member_id]  # that incarnation is gone: done
            elif self.keys.suspect(member_id) not in snap.items:
                del self._pending_reports[member_id]
                self.client.spawn_here(self.asuspect(member_id, evidence, detail, lease=lease), "suspect")

    async def _check_evidence(self, s: Suspicion, snap: RangeSnapshot) -> None:
        """The confirmer's own look at the suspect's listener: a refusal (or a drop) is a
        second observation of the death, and the suspect is confirmed without waiting."""
        kv = snap.items.get(self.keys.member(s.role, s.suspect))
        if kv is None or kv.lease != s.lease:
            return
        with contextlib.suppress(ValueError, KeyError):
            record = MemberRecord.decode(kv.value)
            if record.probe and reachable_probe(record.probe, record.host, self.record.host) \
                    and await probe_dead(record.probe) is not None:
                self._suspicions_verified.add((s.suspect, s.revision))
                self._poke_suspicions()

    def _act(self, s: Suspicion, coro) -> None:
        """Run one refute / confirm / drop of ``s`` at a time (the next decision may see
        the suspicion again before our own write comes back through the watch)."""
        key = (s.suspect, s.revision)
        if key in self._suspicions_acting:
            coro.close()
            return
        self._suspicions_acting.add(key)

        async def run() -> None:
            try:
                await coro
            except Exception as exc:  # etcd trouble: the next change (or the TTL) decides
                self.log.warning("membership.suspect.action_failed", suspect=s.suspect, error=repr(exc)[:200])
            finally:
                self._suspicions_acting.discard(key)
                self._poke_suspicions()

        self.client.spawn_here(run(), "suspicion")

    async def _refute(self, s: Suspicion) -> None:
        # Guarded by our own lease: a suspect fenced first cannot refute afterwards.
        res = await self.client.atxn([Compare(self.keys.suspect(s.suspect), "create", "==", s.revision),
                                      self.ownership_compare()],
                                     [Delete(self.keys.suspect(s.suspect))])
        if res.succeeded:
            self.suspicions_refuted += 1
            self.log.info("membership.suspect.refuted", reporter=s.reporter, evidence=s.evidence,
                          revision=res.revision)

    async def _confirm(self, s: Suspicion, leader_kv) -> None:
        member_key = self.keys.member(s.role, s.suspect)
        suspect_key = self.keys.suspect(s.suspect)
        # One transaction: the same suspicion, still unrefuted, about the incarnation still
        # on that lease, and we are still a member. Deleting the member key here (not only
        # revoking the lease after) is what makes refutation and fencing exclusive.
        res = await self.client.atxn(
            [Compare(suspect_key, "create", "==", s.revision), Compare(member_key, "lease", "==", s.lease),
             self.ownership_compare()],
            [Delete(member_key), Delete(suspect_key)])
        if not res.succeeded:
            return
        self.suspicions_confirmed += 1
        if self.is_leader:
            self._leader.confirmed(res.revision)
        was_leader = leader_kv is not None and leader_kv.lease == s.lease
        self.log.warning("membership.suspect.confirmed", suspect=s.suspect, suspect_lease=s.lease,
                         incarnation=s.incarnation, reporter=s.reporter, evidence=s.evidence, leader=was_leader,
                         revision=res.revision)
        # Frees whatever else the suspect held (the leader key): a takeover needs no TTL.
        for _ in range(3):
            try:
                await self.client.arevoke_lease(s.lease)
                return
            except Exception as exc:
                self.log.warning("membership.suspect.revoke_failed", suspect=s.suspect, error=repr(exc)[:200])
                await asyncio.sleep(0.05)

    async def _drop(self, s: Suspicion) -> None:
        await self.client.atxn([Compare(self.keys.suspect(s.suspect), "create", "==", s.revision)],
                               [Delete(self.keys.suspect(s.suspect))])

    def _lease_back(self) -> None:
        for cb in list(self._on_back):
            with contextlib.suppress(Exception):
                cb()

    def _went_back(self, error: JobStateLost) -> None:
        self.state_lost = error
        self._lease_lost_threadsafe(str(error))

    def _lease_lost_threadsafe(self, reason: str) -> None:
        """etcd answered a keepalive with TTL 0 (keeper thread): the lease is gone."""
        with contextlib.suppress(RuntimeError):  # the client loop is closed already
            self.client.loop.call_soon_threadsafe(self._mark_lost, reason)

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
            self._mark_lost("member key deleted (lease expired or revoked, or fenced as a confirmed suspect)")
        elif not self.closing and mine.lease != self.lease_id:
            self.replaced = True  # another incarnation is this member now: it must not come back
            self._mark_lost(self._taken_over(mine))
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
                # The first few ids only: every member logs this on every epoch, and the
                # whole lists (a join of 1,024 ranks) made it O(members) per member.
                self.log.info("membership.epoch.changed", epoch=new.epoch,
                              num_members=new.num_ranks, num_added=len(d.added), num_removed=len(d.removed),
                              added=[m.member_id for m in d.added[:_LOGGED_IDS]],
                              removed=[m.member_id for m in d.removed[:_LOGGED_IDS]])
                for cb in list(self._on_view):
                    try:
                        cb(old, new)
                    except Exception:
                        self.log.exception("membership.view.callback_failed")
        if reset or any(self.keys.parse_member_key(ev.key) for ev in events):  # the ring follows members only
            self._update_ring(snap)
        # The suspicion loop has nothing to decide while no suspicion exists, none was seen
        # and no report waits: waking it on every change for every member was the bulk of
        # a process's work per change at a thousand members.
        if self._suspicions_seen or self._pending_reports or self._suspicions_acting \
                or self.index(snap).suspicions:
            self._poke_suspicions()
        self._leader.poke()

    def after_publish(self, view: MembershipView) -> None:
        """Leader hook: drop rendezvous keys of epochs no communicator can still use."""
        if view.epoch >= 3:
            old_root = self.keys.store_root

            async def _purge() -> None:
                with contextlib.suppress(Exception):
                    for e in range(max(1, view.epoch - 4), view.epoch - 1):
                        await self.client.adelete(f"{old_root}{e}/", prefix=True)

            self.client.spawn_here(_purge(), "purge-stores")
