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
- ``store/{epoch}/attempts/{seq}`` -> the attempt the epoch's coordinator chose: which
  version moves from which members to which. Epoch-scoped, so it is purged with the epoch.

Bounded: after each commit the coordinator deletes (fenced) the sources and acks of every
older version, and everything of versions more than ``HISTORY_VERSIONS`` older, so the keys
under ``versions/`` stay O(ranks + HISTORY_VERSIONS) however many steps a job runs, and so
does every snapshot read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic_refit.membership.client import Compare, Delete, EtcdClient, Put
from elastic_refit.membership.keys import AttemptKeys, JobKeys
from elastic_refit.membership.service import Membership

from elastic_refit._validate import is_integer

# Committed and failed records of this many versions before the latest committed one stay in
# etcd (a trainer restarted a few versions back gets their commits back; anything older is
# "older than the latest committed version"). Each snapshot reads them all: keep it small.
HISTORY_VERSIONS = 8
_PRUNE_OPS_PER_TXN = 64  # etcd refuses transactions of more than --max-txn-ops (128) operations


@dataclass(frozen=True, slots=True)
class Ack:
    incarnation: str
    epoch: int
    digest: str
    layout: str = ""  # the layout the rank held the version in (its record's, when it acked)


@dataclass(frozen=True, slots=True)
class Commit:
    version: int
    epoch: int
    digest: str


@dataclass(frozen=True, slots=True)
class Failure:
    """``version`` was given up: ``num_attempts`` consecutive attempts failed for ``cause``."""

    version: int
    cause: str
    num_attempts: int
    epoch: int


@dataclass(frozen=True, slots=True)
class VersionState:
    """A consistent snapshot (one etcd read) of every version's sources, acks, commits and
    failures."""

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
            parsed = self.keys.parse_version_key(kv.key)
            if parsed is None:
                continue
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
                state.committed[version] = Commit(int(data["version"]), int(data["epoch"]), str(data["digest"]))
        return state

    def attempt(self, epoch: int, seq: int) -> dict[str, Any] | None:
        kv = self.client.get(self.keys.attempt(epoch, seq))
        return json.loads(kv.value) if kv else None

    def next_attempt(self, epoch: int, seq: int) -> tuple[int, dict[str, Any]] | None:
        """The first attempt of ``epoch`` numbered ``seq`` or later, as ``(seq, attempt)``:
        a member that fell behind skips the attempts the coordinator pruned (every one of
        their participants had finished them, so it took no part)."""
        prefix = self.keys.attempts(epoch)
        kv = self.client.first(self.keys.attempt(epoch, seq), prefix[:-1] + "0")  # '0' follows '/'
        if kv is None:
            return None
        return int(kv.key[len(prefix):]), json.loads(kv.value)

    def prune_attempt(self, epoch: int, seq: int, store_prefix: str) -> None:
        """Delete attempt ``seq`` of ``epoch`` and its participants' keys (under the epoch's
        rendezvous store ``store_prefix``), so an epoch that lasts many versions keeps
        O(ranks) keys. Only for an attempt whose participants all finished it."""
        self.client.txn([], [Delete(self.keys.attempt(epoch, seq)),
                             Delete(store_prefix + AttemptKeys(seq).prefix, prefix=True)])

    # ---- fenced writes ------------------------------------------------------------
    def publish_source(self, membership: Membership, version: int, digest: str = "",
                       regions: Mapping[int, str] | None = None, layout: str = "") -> None:
        """This trainer published ``version`` (its buffers' ``digest`` and its digests of the
        replica ``regions`` it holds, taken at publish, in the layout with fingerprint
        ``layout``) and serves it as a source (fenced on its own lease)."""
        record = {"incarnation": membership.record.incarnation, "digest": digest, "layout": layout,
                  "regions": {str(k): v for k, v in (regions or {}).items()}}
        membership.fenced_put(self.keys.source(version, membership.record.member_id), json.dumps(record).encode())

    def ack(self, membership: Membership, version: int, epoch: int, digest: str) -> None:
        """This inference rank holds ``version``, verified: it is a holder (fenced on its own lease)."""
        record = membership.record
        membership.fenced_put(self.keys.ack(version, record.member_id), json.dumps(
            {"incarnation": record.incarnation, "epoch": epoch, "digest": digest,
             "layout": record.layout}).encode())

    def retract(self, membership: Membership, state: VersionState) -> int:
        """Withdraw this member's acks: its buffers are about to be overwritten, so it must
        not be chosen to serve those versions. Fenced like every member write."""
        member_id = membership.record.member_id
        keys = [self.keys.ack(v, member_id) for v, acks in state.acks.items() if member_id in acks]
        if keys:
            result = self.client.txn([membership.ownership_compare()], [Delete(k) for k in keys], idempotent=True)
            if not result.succeeded:
                membership.check()
                raise RuntimeError(f"{member_id}: could not retract acks {keys}")
        return len(keys)

    def _epoch_guard(self, membership: Membership, epoch: int) -> list[Compare]:
        """Guards for coordinator writes: I still own my key, and ``epoch`` is still current."""
        kv = self.client.get(self.keys.epoch)
        if kv is None or json.loads(kv.value).get("epoch") != epoch:
            return []
        return [membership.ownership_compare(), Compare(self.keys.epoch, "mod", "==", kv.mod_revision)]

    def propose_attempt(self, membership: Membership, epoch: int, seq: int, attempt: dict[str, Any]) -> bool:
        """Create attempt ``seq`` of ``epoch`` if absent and the epoch is still current."""
        guard = self._epoch_guard(membership, epoch)
        if not guard:
            return False
        key = self.keys.attempt(epoch, seq)
        result = self.client.txn(guard + [Compare(key, "create", "==", 0)],
                                 [Put(key, json.dumps(attempt, sort_keys=True).encode())])
        return result.succeeded

    def commit(self, membership: Membership, version: int, epoch: int, digest: str) -> bool:
        """Create ``committed`` for ``version`` once; refused for a stale epoch (fencing) and
        for a version that failed."""
        guard = self._epoch_guard(membership, epoch)
        if not guard:
            return False
        key = self.keys.committed(version)
        value = json.dumps({"version": version, "epoch": epoch, "digest": digest}).encode()
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
        guard = self._epoch_guard(membership, epoch)
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
            guard = self._epoch_guard(membership, epoch)
            if not guard or not self.client.txn(guard, ops[start:start + _PRUNE_OPS_PER_TXN]).succeeded:
                return 0  # fenced off: a newer epoch's coordinator prunes the rest
        return touched
