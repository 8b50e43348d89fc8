"""Leader election with a fencing token, and epoch publication.

The ``leader`` key is created only if absent, on the candidate's member lease, so it
vanishes with the member. Its ``create_revision`` is the fencing token: every epoch write
is a transaction that compares the token and the epoch's ``mod_revision``, so a stale
leader (frozen past its TTL, then resumed) cannot write, and two leaders can never
publish the same epoch number twice. Epoch numbers only ever go up by one.

Membership changes are debounced (a host losing 8 ranks becomes one epoch), except a death
the leader itself just confirmed (``membership/liveness.py``): that epoch goes out at once.
While a suspicion is pending (for at most two refute windows) the leader publishes nothing:
the survivors of a crash ask for a reform as their transfers fail, and an epoch that still
lists the dead member would only strand their rendezvous.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from elastic_refit.membership.admission import (
    Admission,
    Sighting,
    VersionState,
    admit,
    pending_version,
)
from elastic_refit.membership.client import Compare, EtcdClient, Get, Put
from elastic_refit.membership.config import MembershipConfig
from elastic_refit.membership.errors import (
    JOB_STATE_LOST_ADVICE,
    EtcdUnavailable,
    JobStateLost,
    LeadershipLost,
)
from elastic_refit.membership.index import control_index
from elastic_refit.membership.keys import JobKeys
from elastic_refit.membership.view import (
    MemberRecord,
    MembershipView,
    needs_new_epoch,
    next_member_order,
)


class Membership(Protocol):
    """What the leader loop reads and calls on its member (``membership.service.Membership``,
    which builds on this module): its client, keys, record, timeouts, log, lease, watcher,
    flags and fences."""

    client: EtcdClient
    keys: JobKeys
    record: MemberRecord
    config: MembershipConfig
    log: Any
    lease_id: int
    lost: threading.Event
    closing: bool
    is_leader: bool
    fenced_writes: int
    watcher: Any

    def ownership_compare(self) -> Compare: ...

    def after_publish(self, view: MembershipView) -> None: ...


async def apublish_epoch(client, keys, token: int, expected_mod_revision: int,
                         view: MembershipView):
    """The one epoch write: succeeds only if ``token`` still names the leader and the
    epoch key was not modified since ``expected_mod_revision`` (0: absent)."""
    return await client.atxn(
        [Compare(keys.leader, "create", "==", token),
         Compare(keys.epoch, "mod", "==", expected_mod_revision)],
        [Put(keys.epoch, view.encode())],
        [Get(keys.leader), Get(keys.epoch)],
    )


def publish_epoch(client, keys, token: int, expected_mod_revision: int,
                  view: MembershipView):
    """Synchronous :func:`apublish_epoch` (returns the ``TxnResult``)."""
    return client.run(apublish_epoch(client, keys, token, expected_mod_revision, view),
                      timeout_s=client.config.request_timeout_s + 5)


def alive_members(membership: Membership, items) -> list[MemberRecord]:
    """Ready members in a snapshot of the control range (each record decoded once per
    write, shared with the other members of the process)."""
    out = []
    for key, kv in items.items():
        if membership.keys.parse_member_key(key) is None:
            continue
        try:
            record = membership.watcher.decoded(kv, MemberRecord.decode)
        except (ValueError, KeyError):
            membership.log.warning("membership.member.bad_record", key=key)
            continue
        if record.state == "ready":
            out.append(record)
    return out


class LeaderLoop:
    """Campaign for leadership; while leader, publish an epoch per (debounced) change."""

    def __init__(self, membership: Membership):
        self.m = membership
        self.token: int | None = None
        self.last_token: int | None = None  # kept after losing leadership (fencing probes)
        self.epochs_published = 0
        self.changed = asyncio.Event()
        # Revision of a fencing this leader just did (0: none pending): until the epoch
        # without that member is out, changes are not debounced.
        self.urgent_revision = 0
        self._pending_since: dict[tuple[str, int], float] = {}  # suspicion -> first seen (monotonic)
        # Newcomers held out of the epoch while a version is on its way (membership.admission)
        self._versions: Callable[[], VersionState] | None = None
        self._sightings: dict[tuple[str, str, str], Sighting] = {}
        self._held: tuple[str, ...] = ()
        self._holding = False  # set before the version state is read: a commit then wakes the loop

    def confirmed(self, revision: int) -> None:
        """A suspect was fenced at ``revision`` (loop thread): publish without debounce."""
        self.urgent_revision = max(self.urgent_revision, revision)
        self.changed.set()

    def poke(self) -> None:
        """Called on the loop thread after each control-range change."""
        self.changed.set()

    def hold_newcomers_for(self, versions: Callable[[], VersionState], client) -> Callable[..., None]:
        """Hold inference newcomers while a version is on its way (``membership.admission``),
        reading the job's version state from ``versions``; returns the callback for changes
        of that state (any thread): it wakes the loop only while someone is held."""
        self._versions = versions

        def changed(*_: Any) -> None:
            if self._holding:
                client.loop.call_soon_threadsafe(self.changed.set)
        return changed

    def admission(self, current: MembershipView | None, desired: tuple[MemberRecord, ...]) -> Admission:
        """Which of ``desired`` join the next epoch now, logging who is held and admitted."""
        known = {x.identity for x in current.members} if current is not None else set()
        newcomers = [x.identity for x in desired if x.identity not in known and x.role == "inference"]
        if self._versions is None or not newcomers:
            self._holding, self._sightings, self._held = False, {}, ()  # a held newcomer that left: not admitted
            return Admission(desired, (), 0.0, "no newcomer waits")
        self._holding = True
        now, state = time.monotonic(), self._versions()
        self._sightings = {i: self._sightings.get(i) or Sighting(now, pending_version(state)) for i in newcomers}
        out = admit(now, current, desired, self._sightings, state, hold_bound_s=self.m.config.join_hold_s)
        self._holding = bool(out.held)
        return self._log_admission(out, now)

    def _log_admission(self, out: Admission, now: float) -> Admission:
        for member_id in sorted(set(out.held) - set(self._held)):
            self.m.log.info("membership.join.held", newcomer=member_id, hold_s=round(out.hold_s, 3), why=out.why)
        seen = {ident[1]: s for ident, s in self._sightings.items()}
        for member_id in sorted(set(self._held) - set(out.held)):
            s = seen.get(member_id)
            self.m.log.info("membership.join.admitted", newcomer=member_id, waited_for=s.waits_for if s else None,
                            held_s=round(now - s.first_seen, 3) if s else None)
        self._held = out.held
        return out

    def changed_threadsafe(self, client) -> None:
        """Wake the loop from any thread (close, lost)."""
        client.loop.call_soon_threadsafe(self.changed.set)

    async def run(self) -> None:
        m = self.m
        while not m.lost.is_set() and not m.closing:
            try:
                token = await self._campaign()
                if token is None:
                    await self.changed.wait()
                    self.changed.clear()
                    continue
                self.token = self.last_token = token
                m.log.info("membership.leader.elected", token=token)
                await self._catch_up(token)
                m.is_leader = True
                await self._lead(token)
            except LeadershipLost as exc:
                m.log.warning("membership.leader.fenced", token=self.token, reason=str(exc))
            except JobStateLost as exc:  # etcd went back: nothing left to lead (the member stops)
                m.log.error("membership.leader.state_lost", error=str(exc)[:300])
                return
            except EtcdUnavailable as exc:
                m.log.warning("membership.leader.etcd_unavailable", error=str(exc)[:300])
                await asyncio.sleep(0.2)
            except Exception as exc:  # the leader loop must outlive any single fault
                m.log.exception("membership.leader.error", error=repr(exc)[:300])
                await asyncio.sleep(0.2)
            finally:
                m.is_leader = False
                self.token = None

    async def _campaign(self) -> int | None:
        m = self.m
        snap = m.watcher.snapshot()
        if m.keys.leader in snap.items:
            return None
        value = json.dumps({"member_id": m.record.member_id,
                            "incarnation": m.record.incarnation}).encode()
        res = await m.client.atxn(
            [Compare(m.keys.leader, "create", "==", 0), m.ownership_compare()],
            [Put(m.keys.leader, value, m.lease_id)],
            [Get(m.keys.leader)],
        )
        if res.succeeded:
            return res.revision  # the create_revision of the key just written
        return None

    def suspicion_hold_s(self, snap, now: float) -> float:
        """Seconds to hold back the next epoch for pending suspicions of members in
        ``snap`` (0: none): a suspicion resolves (refuted, confirmed or dropped) within a
        refute window; two windows bound the hold if its confirmer is slow or gone."""
        m = self.m
        bound = 2 * m.config.refute_window_s + 0.05
        pending: dict[tuple[str, int], float] = {}
        for s in control_index(m.keys, snap).suspicions:
            member = snap.items.get(m.keys.member(s.role, s.suspect))
            if member is not None and member.lease == s.lease:
                ident = (s.suspect, s.revision)
                pending[ident] = self._pending_since.get(ident, now)
        self._pending_since = pending
        return max(0.0, max((first + bound - now for first in pending.values()), default=0.0))

    def _still_leader(self, snap, token: int) -> bool:
        kv = snap.items.get(self.m.keys.leader)
        return kv is not None and kv.create_revision == token

    async def _lead(self, token: int) -> None:
        m = self.m
        cfg = m.config
        while not m.lost.is_set() and not m.closing:
            snap = m.watcher.snapshot()
            if not self._still_leader(snap, token):
                raise LeadershipLost(f"leader key no longer carries token {token}")
            epoch_kv = snap.items.get(m.keys.epoch)
            current = m.watcher.decoded(epoch_kv, MembershipView.decode) if epoch_kv else None
            admission = self.admission(current, next_member_order(current, alive_members(m, snap.items)))
            if self.urgent_revision and snap.revision >= self.urgent_revision:
                self.urgent_revision = 0  # the fenced member is out of this evaluation
            if needs_new_epoch(current, admission.members):
                hold = self.suspicion_hold_s(snap, time.monotonic())
                if hold > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.changed.wait(), hold)
                    self.changed.clear()
                    continue
                await self._publish(token, current, epoch_kv, admission.members, snap.revision)
                continue  # re-evaluate against the watcher's view of our own write
            try:
                await asyncio.wait_for(self.changed.wait(), admission.hold_s or None)
            except TimeoutError:  # a held newcomer's hold ran out: nothing to debounce
                continue
            self.changed.clear()
            if self.urgent_revision:
                continue  # a confirmed death: no debounce
            # Debounce: let a burst of changes (one host losing 8 ranks) settle into one
            # epoch, but never wait more than max_debounce_s in total.
            started = time.monotonic()
            while time.monotonic() - started < cfg.max_debounce_s and not self.urgent_revision:
                try:
                    await asyncio.wait_for(self.changed.wait(), cfg.debounce_s)
                    self.changed.clear()
                except TimeoutError:
                    break

    async def _publish(self, token, current, epoch_kv, desired, based_on) -> None:
        m = self.m
        new = MembershipView(epoch=(current.epoch + 1) if current else 1, members=desired,
                             based_on_revision=based_on)
        t0 = time.monotonic()
        res = await apublish_epoch(m.client, m.keys, token,
                                   epoch_kv.mod_revision if epoch_kv else 0, new)
        if not res.succeeded:
            leader_kvs = res.gets[0] if res.gets else ()
            if not leader_kvs or leader_kvs[0].create_revision != token:
                m.fenced_writes += 1
                raise LeadershipLost(
                    f"epoch {new.epoch} write rejected: leader token {token} is stale "
                    f"(leader key now {leader_kvs[0].create_revision if leader_kvs else 'absent'})"
                )
            m.log.info("membership.epoch.conflict", epoch=new.epoch)
            self._check_epoch_went_back(res, epoch_kv)
        else:
            self.epochs_published += 1
            removed = {x.member_id for x in current.members} - {x.member_id for x in desired} if current else set()
            m.log.info("membership.epoch.published", epoch=new.epoch, num_members=len(desired),
                       based_on_revision=based_on, revision=res.revision,
                       removed=sorted(removed), seconds=round(time.monotonic() - t0, 4))
            m.after_publish(new)
        await self._catch_up(res.revision)

    def _check_epoch_went_back(self, res, epoch_kv) -> None:
        """After a conflict: the epoch key etcd holds (the failed write's read) modified before
        the write this leader's watcher holds means etcd went back (restored from an older
        copy). The watcher would never bring a newer write, and every retry would conflict
        again at once: stop with ``JobStateLost`` (latched in the client's revision guard,
        so every member of this process learns it)."""
        if epoch_kv is None:
            return
        held = res.gets[1] if res.gets and len(res.gets) > 1 else ()
        held_mod = held[0].mod_revision if held else 0
        if held_mod >= epoch_kv.mod_revision:
            return
        m = self.m
        guard = m.client.revisions
        if guard is not None:
            guard.key_went_back(m.keys.epoch, held_mod, epoch_kv.mod_revision, m.client.endpoint)
        raise JobStateLost(f"etcd holds {m.keys.epoch} at mod revision {held_mod}, where this leader saw it "
                           f"written at revision {epoch_kv.mod_revision}: etcd went back; "
                           + JOB_STATE_LOST_ADVICE)

    async def _catch_up(self, revision: int) -> None:
        """Wait until our watcher has seen ``revision``, so decisions use our own writes."""
        m = self.m
        deadline = time.monotonic() + m.config.epoch_deadline_s
        while m.watcher.revision < revision and time.monotonic() < deadline:
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), 0.5)
