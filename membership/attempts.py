"""The attempt ledger: the one place the attempt protocol is spelled (DESIGN.md, "The
runtime's parts").

Per epoch, the coordinator proposes attempts in order (``store/{epoch}/attempts/{seq}``,
created once, fenced on its ownership and the epoch). Each participant of attempt ``seq``
writes into the epoch's rendezvous store:

- ``attempt/{seq}/plan/{member}``: the fingerprint of the plan it computed; every
  participant checks all the others' before a byte moves (:meth:`AttemptLedger.agree`), or
  its :class:`Done` value when it failed before planning;
- ``attempt/{seq}/done/{member}``: a :class:`Done` once it finished the attempt. A
  destination writes it in one transaction with its ack, so whoever sees every done key
  knows the etcd revision the version state must reach to hold the attempt's acks
  (:class:`FinishedAttempt`).

Entering an epoch, NCCL members vote on the plan they connect ahead (``connect/{member}``).
The runtime never spells these keys nor reads a revision of its own: it asks the ledger.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch.distributed as dist
from elastic_refit.membership.client import Compare, Delete, KeyValue, Put
from elastic_refit.membership.keys import AttemptKeys, connect_key
from elastic_refit.membership.service import Membership
from elastic_refit.membership.store import EtcdStore
from elastic_refit.membership.versions import VersionStore

from elastic_refit.errors import PlanMismatch

__all__ = ["CATCH_UP", "OK", "REFIT", "AttemptLedger", "AttemptSpec", "Done", "DoneKind", "FinishedAttempt",
           "agree_on_plan"]

_CAUSE_CHARS = 300
REFIT = "refit"  # move a newly published version from its sources (and holders)
CATCH_UP = "catchup"  # bring ranks that joined or restarted to the latest committed version, from holders


@dataclass(frozen=True, slots=True)
class AttemptSpec:
    """One attempt to bring ``destinations`` to ``version`` (member ids, sorted).

    ``sources`` are trainers serving the version from the training layout; ``holders`` are
    inference ranks that hold the version and serve it from the inference layout;
    ``destinations`` are inference ranks that receive it.

    Deltas (DESIGN.md, "Deltas"): ``deltas`` are the destinations that hold committed
    version ``base`` verified and may be sent the change against it; every other
    destination gets full bytes.
    """

    version: int
    kind: str
    sources: tuple[str, ...]  # trainers, serving from the training layout
    holders: tuple[str, ...]  # inference ranks that hold the version, serving from the inference layout
    destinations: tuple[str, ...]  # inference ranks that receive the version
    # (member_id, layout fingerprint) of every participant, sorted: the layout each is planned with
    layouts: tuple[tuple[str, str], ...] = ()
    base: int | None = None  # the committed version deltas are taken against
    deltas: tuple[str, ...] = ()  # destinations that hold ``base`` verified (sorted)

    def __post_init__(self) -> None:
        if self.kind not in (REFIT, CATCH_UP):
            raise ValueError(f"attempt kind must be {REFIT!r} or {CATCH_UP!r}, got {self.kind!r}")
        if self.version < 0:
            raise ValueError(f"version must be >= 0, got {self.version}")
        if set(self.destinations) & (set(self.sources) | set(self.holders)):
            raise ValueError("a member cannot be a source or holder and a destination: "
                             f"{sorted(set(self.destinations) & (set(self.sources) | set(self.holders)))}")
        object.__setattr__(self, "layouts", tuple(sorted((str(m), str(fp)) for m, fp in dict(self.layouts).items())))
        unnamed = sorted(set(self.participants) - {m for m, _ in self.layouts})
        if self.layouts and unnamed:
            raise ValueError(f"attempt names no layout for participants {unnamed}")
        object.__setattr__(self, "deltas", tuple(sorted(self.deltas)))
        if self.deltas and (self.base is None or not 0 <= self.base < self.version):
            raise ValueError(f"deltas need a base version older than {self.version}, got base {self.base!r}")
        if set(self.deltas) - set(self.destinations):
            raise ValueError(f"deltas go to destinations only, got {sorted(set(self.deltas) - set(self.destinations))}")

    def layout(self, member_id: str) -> str:
        """The fingerprint of the layout ``member_id`` is planned with ("" if none named)."""
        return dict(self.layouts).get(member_id, "")

    @property
    def participants(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.sources) | set(self.holders) | set(self.destinations)))

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "kind": self.kind, "sources": list(self.sources),
                "holders": list(self.holders), "destinations": list(self.destinations),
                "layouts": dict(self.layouts),
                **({"base": self.base, "deltas": list(self.deltas)} if self.deltas else {})}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AttemptSpec:
        base = data.get("base")
        return cls(int(data["version"]), str(data["kind"]), tuple(data["sources"]), tuple(data["holders"]),
                   tuple(data["destinations"]), tuple(dict(data.get("layouts", {})).items()),
                   None if base is None else int(base), tuple(data.get("deltas", ())))




class DoneKind(Enum):
    """How a participant finished an attempt."""

    OK = "ok"
    FAILED = "failed"  # a fault of its own: a cause the coordinator counts
    ABORTED = "aborted"  # a consequence (a peer failed first, the epoch moved on, etcd, its lease)


@dataclass(frozen=True, slots=True)
class Done:
    """A participant's ``done`` value: its kind and, unless OK, the cause (``"Type: first
    line"``) or the reason it stopped."""

    kind: DoneKind
    cause: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, DoneKind):
            raise ValueError(f"Done.kind must be a DoneKind, got {self.kind!r}")
        if (self.kind is DoneKind.OK) != (self.cause == ""):
            raise ValueError(f"a {self.kind.value} done value needs a cause iff it is not ok, got {self.cause!r}")

    @classmethod
    def failed(cls, cause: str) -> Done:
        return cls(DoneKind.FAILED, cause[:_CAUSE_CHARS] or "unknown")

    @classmethod
    def aborted(cls, reason: str) -> Done:
        return cls(DoneKind.ABORTED, reason[:_CAUSE_CHARS] or "unknown")

    @property
    def ok(self) -> bool:
        return self.kind is DoneKind.OK

    def encode(self) -> str:
        return "ok" if self.ok else f"{self.kind.value}: {self.cause}"

    @classmethod
    def decode(cls, value: str | bytes) -> Done | None:
        """The done value ``value`` holds, or None when it holds something else (a plan
        key holds a fingerprint until its participant fails)."""
        text = value.decode() if isinstance(value, bytes) else value
        if text == "ok":
            return cls(DoneKind.OK)
        for kind in (DoneKind.FAILED, DoneKind.ABORTED):
            prefix = f"{kind.value}: "
            if text.startswith(prefix):
                return cls(kind, text[len(prefix):] or "unknown")
        return None


OK = Done(DoneKind.OK)


@dataclass(frozen=True, slots=True)
class FinishedAttempt:
    """Every participant of an attempt wrote its done value (an attempt that no longer
    exists counts as finished, with none). ``acks_revision``: the etcd revision the version
    state must include to hold the acks its destinations wrote (0: none). ``absent``: the
    attempt is not in what was read: pruned, never proposed, or proposed and not brought by
    a watch yet (its proposer must not take that for finished)."""

    done: Mapping[str, Done]
    acks_revision: int = 0
    absent: bool = False


class AttemptLedger:
    """Reads and fenced writes of one job's attempts (next to :class:`VersionStore`, whose
    keys and fencing it shares). Reads take ``known``: the keys of the epoch's store as a
    watch of it holds them, searched instead of reading etcd."""

    def __init__(self, versions: VersionStore) -> None:
        self.versions = versions
        self.client = versions.client
        self.keys = versions.keys

    def store_prefix(self, epoch: int) -> str:
        """The prefix of ``epoch``'s store: what a watch of the epoch's attempts covers."""
        return self.keys.store(epoch)

    # ---- the coordinator's records ------------------------------------------------------
    def attempt(self, epoch: int, seq: int, known: Mapping[str, KeyValue] | None = None) -> AttemptSpec | None:
        """Attempt ``seq`` of ``epoch`` as proposed, or None."""
        key = self.keys.attempt(epoch, seq)
        kv = known.get(key) if known is not None else self.client.get(key)
        return AttemptSpec.from_json(json.loads(kv.value)) if kv else None

    def next_attempt(self, epoch: int, seq: int,
                     known: Mapping[str, KeyValue] | None = None) -> tuple[int, AttemptSpec] | None:
        """The first attempt of ``epoch`` numbered ``seq`` or later, as ``(seq, attempt)``:
        a member that fell behind skips the attempts the coordinator pruned (every one of
        their participants had finished them, so it took no part)."""
        if known is not None:
            found = [(parsed[1], kv) for kv in known.values()
                     if (parsed := self.keys.parse_attempt_key(kv.key)) is not None
                     and parsed[0] == epoch and parsed[1] >= seq]
            if not found:
                return None
            first, kv = min(found, key=lambda item: item[0])
            return first, AttemptSpec.from_json(json.loads(kv.value))
        prefix = self.keys.attempts(epoch)
        kv = self.client.first(self.keys.attempt(epoch, seq), prefix[:-1] + "0")  # '0' follows '/'
        if kv is None:
            return None
        return int(kv.key[len(prefix):]), AttemptSpec.from_json(json.loads(kv.value))

    def propose(self, membership: Membership, epoch: int, seq: int, attempt: AttemptSpec) -> bool:
        """Create attempt ``seq`` of ``epoch`` if absent and the epoch is still current."""
        guard = self.versions.epoch_guard(membership, epoch)
        if not guard:
            return False
        key = self.keys.attempt(epoch, seq)
        result = self.client.txn(guard + [Compare(key, "create", "==", 0)],
                                 [Put(key, json.dumps(attempt.to_json(), sort_keys=True).encode())])
        return result.succeeded

    def prune(self, epoch: int, seq: int, store: EtcdStore) -> None:
        """Delete attempt ``seq`` of ``epoch`` and its participants' keys, so an epoch that
        lasts many versions keeps O(ranks) keys. Only for an attempt whose participants all
        finished it."""
        self.client.txn([], [Delete(self.keys.attempt(epoch, seq)),
                             Delete(store.prefix + AttemptKeys(seq).prefix, prefix=True)])

    # ---- a participant's keys -----------------------------------------------------------
    @staticmethod
    def plan_keys(seq: int, participants: Sequence[str]) -> list[str]:
        return [AttemptKeys(seq).plan(m) for m in participants]

    @staticmethod
    def done_keys(seq: int, participants: Sequence[str]) -> list[str]:
        return [AttemptKeys(seq).done(m) for m in participants]

    @staticmethod
    def written(store: EtcdStore, keys: Sequence[str], known: Mapping[str, KeyValue] | None = None) -> bool:
        """Whether every one of ``keys`` (from :meth:`plan_keys`, ...) is in ``store``."""
        return len(store.read(list(keys), known)) == len(set(keys))

    def agree(self, store: EtcdStore, seq: int, fingerprint: str, *, me: str, participants: Sequence[str],
              wait: Callable[[list[str]], None], refused: Callable[[str, Done], None]) -> None:
        """:func:`agree_on_plan` for attempt ``seq``; ``refused(member, done)`` sees a
        participant that failed before planning (its plan key holds its :class:`Done`)."""
        def failed_first(participant: str, value: str) -> None:
            done = Done.decode(value)
            if done is not None:
                refused(participant, done)

        agree_on_plan(store, fingerprint, me=me, participants=participants, key=AttemptKeys(seq).plan, wait=wait,
                      refused=failed_first)

    def finish(self, store: EtcdStore, seq: int, me: str, done: Done, *, planned: bool) -> None:
        """Write ``me``'s done value of attempt ``seq`` (and, when it failed before its plan
        key was written, the same value there: peers waiting for its plan fail now)."""
        if not planned:
            store.set(AttemptKeys(seq).plan(me), done.encode())
        store.set(AttemptKeys(seq).done(me), done.encode())

    def ack(self, membership: Membership, store: EtcdStore, seq: int, version: int, epoch: int,
            digest: str) -> None:
        """This destination holds ``version``, verified, and finished attempt ``seq``: its
        ack and its done key in one fenced transaction."""
        done = AttemptKeys(seq).done(membership.record.member_id)
        self.versions.ack(membership, version, epoch, digest, done=(store.etcd_key(done), OK.encode().encode()))

    def done_values(self, store: EtcdStore, seq: int, participants: Sequence[str],
                    known: Mapping[str, KeyValue] | None = None) -> dict[str, tuple[Done, int]]:
        """Participant -> (its done value, the revision it was written at), for those that
        wrote one (one read; none with ``known``)."""
        keys = dict(zip(participants, self.done_keys(seq, participants), strict=True))
        found = store.read(list(keys.values()), known)
        out = {}
        for member_id, key in keys.items():
            kv = found.get(key)
            done = Done.decode(kv.value) if kv is not None else None
            if done is not None:
                out[member_id] = (done, kv.mod_revision)
        return out

    def finished(self, store: EtcdStore | None, epoch: int, seq: int,
                 known: Mapping[str, KeyValue] | None = None) -> FinishedAttempt | None:
        """Attempt ``seq`` of ``epoch`` is over: absent (``FinishedAttempt.absent``), or
        every participant wrote its done value. None while a participant is still in it (or
        without the epoch's store)."""
        record = self.attempt(epoch, seq, known)
        if record is None:
            return FinishedAttempt({}, absent=True)
        if store is None:
            return None
        done = self.done_values(store, seq, record.participants, known)
        if len(done) < len(record.participants):
            return None
        destinations = set(record.destinations)
        revision = max((rev for m, (d, rev) in done.items() if m in destinations and d.ok), default=0)
        return FinishedAttempt({m: d for m, (d, _) in done.items()}, revision)

    # ---- connecting ahead ---------------------------------------------------------------
    @staticmethod
    def connect_keys(participants: Sequence[str]) -> list[str]:
        return [connect_key(m) for m in participants]

    def vote_connect(self, store: EtcdStore, me: str, value: str) -> None:
        """``me`` would connect the pairs of the plan ``value`` names (or ``skip: <why>``)."""
        store.set(connect_key(me), value)

    def connect_votes(self, store: EtcdStore, participants: Sequence[str]) -> list[str]:
        return [v.decode() for v in store.multi_get(self.connect_keys(participants))]


def agree_on_plan(store: dist.Store, fingerprint: str, *, me: str, participants: Sequence[str],
                  key: Callable[[str], str], wait: Callable[[list[str]], None] | None = None,
                  refused: Callable[[str, str], None] | None = None) -> None:
    """Plan agreement (DESIGN.md, invariant 4): publish ``fingerprint`` under ``key(me)``,
    wait for every participant's key (with ``wait(keys)``, default ``store.wait``) and raise
    :class:`PlanMismatch` naming the first participant whose value differs. A participant
    that could not plan publishes a marker instead of a fingerprint; ``refused(participant,
    value)`` sees such values first and may raise an error of its own."""
    if me not in participants:
        raise ValueError(f"{me!r} is not among the participants {list(participants)}")
    store.set(key(me), fingerprint)
    keys = [key(p) for p in participants]
    (wait or store.wait)(keys)
    for participant, theirs in zip(participants, store.multi_get(keys), strict=True):
        other = theirs.decode()
        if other != fingerprint:
            if refused is not None:
                refused(participant, other)
            raise PlanMismatch(f"{me} planned {fingerprint} but {participant} planned {other}")
