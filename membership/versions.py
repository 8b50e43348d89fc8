"""Weight versions on etcd: who published a version, who holds it, attempts and commits.

Keys (under ``/elastic-refit/{job}/``):

- ``versions/{v}/sources/{member_id}`` -> ``{incarnation, digest, layout, regions}``: a
  trainer published version ``v`` in the layout ``layout`` names and serves it (as a
  source) until ``v`` commits.
- ``versions/{v}/acks/{member_id}`` -> ``{incarnation, epoch, digest, layout}``: an inference
  rank holds ``v``, verified, in its layout ``layout`` (a holder). Written fenced: a member
  that lost its lease cannot ack.
- ``versions/{v}/committed`` -> ``{version, epoch, digest}``: created once, only while the
  epoch it names is still the current one.
- ``versions/{v}/failed`` -> ``{version, cause, num_attempts, epoch}``: ``v`` failed that
  many consecutive attempts for one cause and is given up. Created once, by the coordinator
  of the current epoch, and never for a committed version (nor a commit for a failed one).

Attempts (``store/{epoch}/attempts/{seq}`` and their participants' keys) are the attempt
ledger's (``membership.attempts``).

Bounded: after each commit the coordinator deletes (fenced) the sources and acks of every
older version, and everything of versions more than ``HISTORY_VERSIONS`` older, so the keys
under ``versions/`` stay O(ranks + HISTORY_VERSIONS) however many steps a job runs, and so
does every snapshot read.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from elastic_refit.membership.client import Compare, Delete, EtcdClient, KeyValue, Put, _prefix_end
from elastic_refit.membership.keys import JobKeys
from elastic_refit.membership.service import Membership
from elastic_refit.membership.view import MembershipView
from elastic_refit.membership.watch import RangeWatcher, WatchEvent, WatchHub

from elastic_refit._validate import is_integer
from elastic_refit.log import get_logger

# Committed and failed records of this many versions before the latest committed one stay in
# etcd (a trainer restarted a few versions back gets their commits back; anything older is
# "older than the latest committed version"). Each snapshot reads them all: keep it small.
HISTORY_VERSIONS = 8
_PRUNE_OPS_PER_TXN = 64  # etcd refuses transactions of more than --max-txn-ops (128) operations
# Members per batched write (ack_many, publish_many): one ownership compare and up to two
# puts each, within etcd's --max-txn-ops (128) of each kind.
_MEMBERS_PER_TXN = 64


@dataclass(frozen=True, slots=True)
class AckRequest:
    """One inference rank's ack of ``version`` for :meth:`VersionStore.ack_many`."""

    membership: Membership
    version: int
    epoch: int
    digest: str
    done: tuple[str, bytes] | None = None


@dataclass(frozen=True, slots=True)
class Ack:
    incarnation: str
    epoch: int
    digest: str
    layout: str = ""  # the layout the rank held the version in (its record's, when it acked)


@dataclass(frozen=True, slots=True)
class Commit:
    """``version`` committed in ``epoch``: ``digest`` of what its inference ranks hold;
    ``sources``: (trainer, digest of the data it published as ``version``) of its sources,
    so a later ``publish`` of the version with other data is refused after the sources'
    records are pruned (a second run reusing the job's name)."""

    version: int
    epoch: int
    digest: str
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def source_digest(self, member_id: str) -> str | None:
        """The digest of the data trainer ``member_id`` published as this version, if known."""
        return dict(self.sources).get(member_id)


@dataclass(frozen=True, slots=True)
class Failure:
    """``version`` was given up: ``num_attempts`` consecutive attempts failed for ``cause``."""

    version: int
    cause: str
    num_attempts: int
    epoch: int


@dataclass(frozen=True, slots=True)
class VersionState:
    """A consistent view of every version's sources, acks, commits and failures at
    ``revision``: one etcd read (:meth:`VersionStore.snapshot`) or a watched copy
    (:meth:`VersionTracker.state`, what the runtime uses)."""

    revision: int
    sources: dict[int, dict[str, str]] = field(default_factory=dict)  # v -> member -> incarnation
    # v -> member -> digest of the buffers that trainer published as v (taken at publish)
    source_digests: dict[int, dict[str, str]] = field(default_factory=dict)
    # v -> member -> replica region index -> that trainer's digest of the region
    source_regions: dict[int, dict[str, dict[int, str]]] = field(default_factory=dict)
    # v -> member -> fingerprint of the layout that trainer published v in
    source_layouts: dict[int, dict[str, str]] = field(default_factory=dict)
    acks: dict[int, dict[str, Ack]] = field(default_factory=dict)
    committed: dict[int, Commit] = field(default_factory=dict)
    failed: dict[int, Failure] = field(default_factory=dict)

    @property
    def latest_committed(self) -> int | None:
        return max(self.committed) if self.committed else None


def record_version_key(state: VersionState, keys: JobKeys, kv: KeyValue) -> None:
    """Add one key under ``versions/`` to ``state`` (anything else is ignored)."""
    parsed = keys.parse_version_key(kv.key)
    if parsed is None:
        return
    version, kind, member_id = parsed
    data = json.loads(kv.value)
    if kind == "sources":
        state.sources.setdefault(version, {})[member_id] = str(data["incarnation"])  # type: ignore[index]
        if data.get("digest"):
            state.source_digests.setdefault(version, {})[member_id] = str(data["digest"])  # type: ignore[index]
        if data.get("layout"):
            state.source_layouts.setdefault(version, {})[member_id] = str(data["layout"])  # type: ignore[index]
        if data.get("regions"):
            state.source_regions.setdefault(version, {})[member_id] = {  # type: ignore[index]
                int(k): str(v) for k, v in data["regions"].items()}
    elif kind == "acks":
        state.acks.setdefault(version, {})[member_id] = Ack(  # type: ignore[index]
            str(data["incarnation"]), int(data["epoch"]), str(data["digest"]), str(data.get("layout", "")))
    elif kind == "failed":
        state.failed[version] = Failure(int(data["version"]), str(data["cause"]),
                                        int(data["num_attempts"]), int(data["epoch"]))
    else:
        state.committed[version] = Commit(int(data["version"]), int(data["epoch"]), str(data["digest"]),
                                          tuple(sorted((str(m), str(d)) for m, d in data.get("sources", {}).items())))


def forget_version_key(state: VersionState, keys: JobKeys, key: str) -> None:
    """Remove a deleted key under ``versions/`` from ``state``."""
    parsed = keys.parse_version_key(key)
    if parsed is None:
        return
    version, kind, member_id = parsed
    if kind in ("sources", "acks"):
        tables = ((state.sources, state.source_digests, state.source_layouts, state.source_regions)
                  if kind == "sources" else (state.acks,))
        for table in tables:
            per_member = table.get(version)
            if per_member is not None:
                per_member.pop(member_id, None)  # type: ignore[arg-type]
                if not per_member:
                    del table[version]
    elif kind == "failed":
        state.failed.pop(version, None)
    else:
        state.committed.pop(version, None)


def _copy_state(state: VersionState) -> VersionState:
    def per_version(table: dict) -> dict:
        return {v: dict(inner) for v, inner in table.items()}

    return VersionState(state.revision, per_version(state.sources), per_version(state.source_digests),
                        {v: {m: dict(r) for m, r in inner.items()} for v, inner in state.source_regions.items()},
                        per_version(state.source_layouts), per_version(state.acks), dict(state.committed),
                        dict(state.failed))


class VersionTracker:
    """The job's :class:`VersionState`, kept current by a list-then-watch of ``versions/``.

    Each key is parsed once, when it arrives, instead of re-reading and decoding the whole
    prefix on every change (O(ranks) per read, and so O(ranks^2) per version once every
    ack wakes every reader). Give several trackers of one process the same ``hub`` (a
    :class:`~membership.watch.WatchHub` of the versions prefix) to share one stream.

    ``on_change(callback)``: ``callback(reset, events)`` on the client loop thread after
    the state took the change in (it must not block).
    """

    def __init__(self, client: EtcdClient, job: str, *, hub: WatchHub | None = None,
                 progress_interval_s: float = 1.0, stall_timeout_s: float = 3.0) -> None:
        self.keys = JobKeys(job)
        prefix = self.keys.versions_prefix
        self.watcher = hub.view() if hub is not None else RangeWatcher(
            client, prefix, _prefix_end(prefix.encode()).decode(), name="versions",
            progress_interval_s=progress_interval_s, stall_timeout_s=stall_timeout_s)
        self._lock = threading.Lock()
        self._applied = threading.Condition(self._lock)  # see state_at
        self._state = VersionState(revision=0)
        self._callbacks: list[Callable[[bool, list[WatchEvent]], None]] = []
        self.watcher.add_listener(self._apply)

    def start(self, timeout_s: float = 10.0) -> VersionTracker:
        self.watcher.start(timeout_s)
        return self

    def stop(self) -> None:
        self.watcher.stop()

    def on_change(self, callback: Callable[[bool, list[WatchEvent]], None]) -> None:
        self._callbacks.append(callback)

    def state(self) -> VersionState:
        """A copy of the current state (no etcd read; no JSON decoded)."""
        with self._lock:
            return _copy_state(self._state)

    def state_at(self, revision: int, timeout_s: float) -> VersionState | None:
        """A copy of the state once it took in every change up to etcd ``revision``, which
        must be the revision of a write under ``versions/`` (e.g. an ack, written in one
        transaction with the done key a reader saw): the watch delivers that write, so the
        wait ends. ``None`` after ``timeout_s`` (a stalled stream: read etcd instead)."""
        with self._applied:
            if not self._applied.wait_for(lambda: self._state.revision >= revision, timeout_s):
                return None
            return _copy_state(self._state)

    @property
    def revision(self) -> int:
        with self._lock:
            return self._state.revision

    def num_acks(self, version: int) -> int:
        """How many inference ranks acked ``version`` (any incarnation): O(1)."""
        with self._lock:
            return len(self._state.acks.get(version, ()))

    def committed(self, version: int) -> Commit | None:
        with self._lock:
            return self._state.committed.get(version)

    def _apply(self, reset: bool, events: list[WatchEvent], snap) -> None:
        with self._lock:
            if reset:
                fresh = VersionState(revision=snap.revision)
                for kv in snap.items.values():
                    record_version_key(fresh, self.keys, kv)
                self._state = fresh
            else:
                for ev in events:
                    if ev.kind == "put":
                        record_version_key(self._state, self.keys, ev.kv)  # type: ignore[arg-type]
                    else:
                        forget_version_key(self._state, self.keys, ev.key)
                self._state = replace(self._state, revision=snap.revision)  # the tables stay shared
            self._applied.notify_all()
        for callback in list(self._callbacks):
            try:
                callback(reset, events)
            except Exception:  # a consumer's bug must not stop the tracking
                get_logger(component="versions").exception("membership.versions.callback_failed")


class VersionStore:
    """Reads and fenced writes of version state for one job."""

    def __init__(self, client: EtcdClient, job: str) -> None:
        self.client = client
        self.keys = JobKeys(job)

    # ---- reads --------------------------------------------------------------------
    def snapshot(self) -> VersionState:
        """Every version key in one range read."""
        result = self.client.get_prefix(self.keys.versions_prefix)
        state = VersionState(revision=result.revision)
        for kv in result.kvs:
            record_version_key(state, self.keys, kv)
        return state

    # ---- fenced writes ------------------------------------------------------------
    def publish_source(self, membership: Membership, version: int, digest: str = "",
                       regions: Mapping[int, str] | None = None, layout: str = "") -> None:
        """This trainer published ``version`` (its buffers' ``digest`` and its digests of the
        replica ``regions`` it holds, taken at publish, in the layout with fingerprint
        ``layout``) and serves it as a source (fenced on its own lease)."""
        membership.fenced_put(*self._source_entry(membership, version, digest, regions, layout))

    def _source_entry(self, membership: Membership, version: int, digest: str, regions: Mapping[int, str] | None,
                      layout: str) -> tuple[str, bytes]:
        record = {"incarnation": membership.record.incarnation, "digest": digest, "layout": layout,
                  "regions": {str(k): v for k, v in (regions or {}).items()}}
        return self.keys.source(version, membership.record.member_id), json.dumps(record).encode()

    def ack(self, membership: Membership, version: int, epoch: int, digest: str,
            done: tuple[str, bytes] | None = None) -> None:
        """This inference rank holds ``version``, verified: it is a holder (fenced on its own lease).

        ``done``: ``(key, value)`` of the attempt's done key, written in the same transaction
        (one etcd write per destination and attempt, not two: at 1,024 ranks the writes of
        one round are what etcd spends its time on)."""
        membership.fenced_put(*self._ack_entry(membership, version, epoch, digest),
                              also=[Put(*done)] if done is not None else ())

    def ack_many(self, requests: Sequence[AckRequest]) -> list[BaseException | None]:
        """:meth:`ack` for the members of one process (a host agent), in one transaction per
        ``_MEMBERS_PER_TXN`` members, each member's ack (and done key) fenced on its own
        lease as alone. Returns, per request, ``None`` or the error its own ack raised.

        Why: a commit round at 1,024 ranks is 1,024 fenced writes, each one etcd request,
        raft entry and watch response; etcd's time on them, not the decisions, bounded the
        round on one machine. Batched, it is 16 requests."""
        def puts(r: AckRequest) -> list[Put]:
            return [Put(*self._ack_entry(r.membership, r.version, r.epoch, r.digest)),
                    *([Put(*r.done)] if r.done is not None else [])]

        return self._fenced_many([(r.membership, puts(r)) for r in requests],
                                 lambda i: self.ack(requests[i].membership, requests[i].version, requests[i].epoch,
                                                    requests[i].digest, done=requests[i].done))

    def publish_many(self, memberships: Sequence[Membership], version: int, digest: str = "",
                     layout: str = "") -> list[BaseException | None]:
        """:meth:`publish_source` (without regions) for the trainers of one process, batched
        like :meth:`ack_many`."""
        return self._fenced_many(
            [(m, [Put(*self._source_entry(m, version, digest, None, layout))]) for m in memberships],
            lambda i: self.publish_source(memberships[i], version, digest, layout=layout))

    def _fenced_many(self, writes: Sequence[tuple[Membership, list[Put]]],
                     alone: Callable[[int], None]) -> list[BaseException | None]:
        """Each member's ``puts``, fenced on its own lease, in one transaction per
        ``_MEMBERS_PER_TXN`` members. A transaction refused because a member lost its lease
        is replayed member by member (``alone(i)``), so the others still write and only the
        lost one gets :class:`MembershipLost`, as if each had written alone."""
        errors: list[BaseException | None] = [None] * len(writes)
        for start in range(0, len(writes), _MEMBERS_PER_TXN):
            chunk = []
            for i, (membership, puts) in enumerate(writes[start:start + _MEMBERS_PER_TXN], start):
                try:
                    membership.check()  # a member known lost writes nothing
                except Exception as exc:
                    errors[i] = exc
                else:
                    chunk.append((i, membership, puts))
            if not chunk:
                continue
            try:
                # Guarded only by the members' own leases: safe to retry through an outage.
                if self.client.txn([m.ownership_compare() for _, m, _ in chunk],
                                   [p for _, _, puts in chunk for p in puts], idempotent=True).succeeded:
                    continue
            except Exception as exc:
                for i, _, _ in chunk:
                    errors[i] = exc
                continue
            for i, _, _ in chunk:  # someone is lost: each on its own, to name who
                try:
                    alone(i)
                except Exception as exc:
                    errors[i] = exc
        return errors

    def _ack_entry(self, membership: Membership, version: int, epoch: int, digest: str) -> tuple[str, bytes]:
        record = membership.record
        return self.keys.ack(version, record.member_id), json.dumps(
            {"incarnation": record.incarnation, "epoch": epoch, "digest": digest, "layout": record.layout}).encode()

    def retract(self, membership: Membership, state: VersionState, also: Iterable[int] = ()) -> int:
        """Withdraw this member's acks: its buffers are about to be overwritten, so it must
        not be chosen to serve those versions. Fenced like every member write. ``also``:
        versions this member acked that ``state`` (a watched copy) may not show yet."""
        member_id = membership.record.member_id
        versions = {v for v, acks in state.acks.items() if member_id in acks} | set(also)
        keys = [self.keys.ack(v, member_id) for v in sorted(versions)]
        if keys:
            result = self.client.txn([membership.ownership_compare()], [Delete(k) for k in keys], idempotent=True)
            if not result.succeeded:
                membership.check()
                raise RuntimeError(f"{member_id}: could not retract acks {keys}")
        return len(keys)

    def epoch_guard(self, membership: Membership, epoch: int) -> list[Compare]:
        """Guards for coordinator writes (here and in the attempt ledger): I still own my key, and ``epoch`` is still current."""
        # The member's watched copy of the epoch key, decoded once per epoch write: reading
        # and decoding the key here cost O(members) per coordinator write. A stale copy is
        # harmless: the guard compares its mod_revision, so the write is refused.
        kv = membership.watcher.snapshot().items.get(self.keys.epoch)
        if kv is None or membership.watcher.decoded(kv, MembershipView.decode).epoch != epoch:
            return []
        return [membership.ownership_compare(), Compare(self.keys.epoch, "mod", "==", kv.mod_revision)]

    def commit(self, membership: Membership, version: int, epoch: int, digest: str,
               sources: Mapping[str, str] | None = None) -> bool:
        """Create ``committed`` for ``version`` once (``sources``: trainer -> digest of the
        data it published, kept with the commit, see :class:`Commit`); refused for a stale
        epoch (fencing) and for a version that failed."""
        guard = self.epoch_guard(membership, epoch)
        if not guard:
            return False
        key = self.keys.committed(version)
        value = json.dumps({"version": version, "epoch": epoch, "digest": digest,
                            "sources": dict(sources or {})}).encode()
        return self.client.txn(guard + [Compare(key, "create", "==", 0),
                                        Compare(self.keys.failed(version), "create", "==", 0)],
                               [Put(key, value)]).succeeded

    def refuse(self, membership: Membership, version: int, cause: str) -> bool:
        """Create ``failed`` for ``version`` with no attempt: this trainer refused its own
        input for it, and every live trainer must source a version, so it can never
        commit; its peers then raise at once instead of waiting for it. Fenced on this
        member's ownership; refused for a version that committed or already failed."""
        key = self.keys.failed(version)
        value = json.dumps({"version": version, "cause": cause, "num_attempts": 0, "epoch": -1}).encode()
        return self.client.txn([membership.ownership_compare(), Compare(key, "create", "==", 0),
                                Compare(self.keys.committed(version), "create", "==", 0)],
                               [Put(key, value)]).succeeded

    def fail(self, membership: Membership, version: int, epoch: int, cause: str, num_attempts: int) -> bool:
        """Create ``failed`` for ``version`` once: it failed ``num_attempts`` consecutive
        attempts for ``cause``. Refused for a stale epoch (fencing) and for a version that
        committed."""
        guard = self.epoch_guard(membership, epoch)
        if not guard:
            return False
        key = self.keys.failed(version)
        value = json.dumps({"version": version, "cause": cause, "num_attempts": num_attempts,
                            "epoch": epoch}).encode()
        return self.client.txn(guard + [Compare(key, "create", "==", 0),
                                        Compare(self.keys.committed(version), "create", "==", 0)],
                               [Put(key, value)]).succeeded

    def prune(self, membership: Membership, epoch: int, state: VersionState, latest: int,
              history: int = HISTORY_VERSIONS) -> int:
        """Once ``latest`` committed: delete what nobody needs any more, fenced like a commit
        (only the coordinator of the current ``epoch`` prunes). Every version older than
        ``latest`` loses its sources and acks (a catch-up serves the latest committed version,
        from its holders; an older one is never moved again); versions more than ``history``
        older lose their committed and failed records too. ``state`` lists what exists.
        Returns the number of versions pruned (0 when fenced off: an epoch that is not the
        current one prunes nothing)."""
        if not is_integer(history) or history < 0:
            raise ValueError(f"history must be an integer >= 0, got {history!r}")
        ops: list[Delete] = []
        touched = 0
        for v in sorted(set(state.sources) | set(state.acks) | set(state.committed) | set(state.failed)):
            if v >= latest:
                break
            if v < latest - history:
                ops.append(Delete(self.keys.version(v), prefix=True))
            else:
                ops += [Delete(self.keys.sources(v), prefix=True)] if v in state.sources else []
                ops += [Delete(self.keys.acks(v), prefix=True)] if v in state.acks else []
                if v not in state.sources and v not in state.acks:
                    continue
            touched += 1
        for start in range(0, len(ops), _PRUNE_OPS_PER_TXN):
            guard = self.epoch_guard(membership, epoch)
            if not guard or not self.client.txn(guard, ops[start:start + _PRUNE_OPS_PER_TXN]).succeeded:
                return 0  # fenced off: a newer epoch's coordinator prunes the rest
        return touched
