"""Member records and the frozen membership view of one epoch.

A view is what every rank agrees on for one epoch: the ordered member list (its index is
the communicator rank) and the members grouped by role. Views are plain data, built from
the ``epoch`` key, and compared with :func:`diff`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from elastic_refit.membership.keys import ROLES, check_name, check_role

MEMBER_STATES: tuple[str, ...] = ("joining", "ready", "leaving")


@dataclass(frozen=True, slots=True)
class MemberRecord:
    """What ``members/{role}/{member_id}`` holds: one rank's identity and address."""

    role: str
    member_id: str
    incarnation: str
    host: str
    domain: str
    device: str
    address: str = ""
    state: str = "ready"
    layout_rank: int = -1  # this rank's rank in its side's layout (-1: not part of a layout)
    # Fingerprint of the layout this rank describes its side with (``layouts/{fingerprint}``;
    # "" for a member that takes part in no layout).
    layout: str = ""
    # Bumped to ask for a new epoch with the same members: this rank's communicator broke
    # (gloo closes a pair for good once it times out or its peer resets it).
    reform: int = 0
    # The latest epoch this member knew of when it asked for the reform: a request made
    # before a newer epoch reached it (a peer's death already replaced the communicator) is
    # stale, and no reason for another epoch.
    reform_epoch: int = 0
    # ``host:port`` of this incarnation's liveness listener ("" for none): the ring's peers
    # hold a connection to it, and its end without a goodbye is evidence of death.
    probe: str = ""
    # Whether this rank's executors take deltas (``TransferSettings.delta_base_bytes > 0``):
    # an attempt goes as deltas only when every member in it does (``runtime.deltas``).
    deltas: bool = False
    # The incarnation this process had before its lease was lost and it registered again
    # (``runtime.rejoin``; "" for a process's first registration), and how many times it did:
    # ``status`` tells a member that came back on its own from a restarted one.
    rejoined_from: str = ""
    rejoins: int = 0
    # An inference rank's fingerprint of what it holds (the replicas of one shard share it;
    # "" for none): the leader may hold a newcomer a live rank can catch up (admission).
    shard: str = ""

    def __post_init__(self) -> None:
        check_role(self.role)
        if not isinstance(self.deltas, bool):
            raise ValueError(f"deltas must be a bool, got {self.deltas!r}")
        if not isinstance(self.rejoined_from, str):
            raise ValueError(f"rejoined_from must be an incarnation string, got {self.rejoined_from!r}")
        if isinstance(self.rejoins, bool) or not isinstance(self.rejoins, int) or self.rejoins < 0:
            raise ValueError(f"rejoins must be an int >= 0, got {self.rejoins!r}")
        if isinstance(self.layout_rank, bool) or not isinstance(self.layout_rank, int) or self.layout_rank < -1:
            raise ValueError(f"layout_rank must be an int >= -1, got {self.layout_rank!r}")
        if isinstance(self.reform, bool) or not isinstance(self.reform, int) or self.reform < 0:
            raise ValueError(f"reform must be an int >= 0, got {self.reform!r}")
        if isinstance(self.reform_epoch, bool) or not isinstance(self.reform_epoch, int) or self.reform_epoch < 0:
            raise ValueError(f"reform_epoch must be an int >= 0, got {self.reform_epoch!r}")
        check_name("member_id", self.member_id)
        if not self.incarnation:
            raise ValueError(f"incarnation must be non-empty, got {self.incarnation!r}")
        if not self.host:
            raise ValueError(f"host must be non-empty, got {self.host!r}")
        if not self.domain:
            raise ValueError(f"domain must be non-empty, got {self.domain!r}")
        if not self.device:
            raise ValueError(f"device must be non-empty, got {self.device!r}")
        if not isinstance(self.probe, str):
            raise ValueError(f"probe must be a host:port string, got {self.probe!r}")
        if not isinstance(self.layout, str):
            raise ValueError(f"layout must be a fingerprint string, got {self.layout!r}")
        if self.state not in MEMBER_STATES:
            raise ValueError(f"state must be one of {MEMBER_STATES}, got {self.state!r}")

    @property
    def identity(self) -> tuple[str, str, str]:
        """(role, member_id, incarnation): a restart is a different identity."""
        return (self.role, self.member_id, self.incarnation)

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "member_id": self.member_id,
            "incarnation": self.incarnation,
            "host": self.host,
            "domain": self.domain,
            "device": self.device,
            "address": self.address,
            "state": self.state,
            "layout_rank": self.layout_rank,
            "layout": self.layout,
            "reform": self.reform,
            "reform_epoch": self.reform_epoch,
            "probe": self.probe,
            "deltas": self.deltas,
            "rejoined_from": self.rejoined_from,
            "rejoins": self.rejoins,
            "shard": self.shard,
        }

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MemberRecord:
        return cls(
            role=str(data["role"]),
            member_id=str(data["member_id"]),
            incarnation=str(data["incarnation"]),
            host=str(data["host"]),
            domain=str(data["domain"]),
            device=str(data["device"]),
            address=str(data.get("address", "")),
            state=str(data.get("state", "ready")),
            layout_rank=int(data.get("layout_rank", -1)),
            layout=str(data.get("layout", "")),
            reform=int(data.get("reform", 0)),
            reform_epoch=int(data.get("reform_epoch", 0)),
            probe=str(data.get("probe", "")),
            deltas=bool(data.get("deltas", False)),
            rejoined_from=str(data.get("rejoined_from", "")),
            rejoins=int(data.get("rejoins", 0)),
            shard=str(data.get("shard", "")),
        )

    @classmethod
    def decode(cls, raw: bytes) -> MemberRecord:
        return cls.from_json(json.loads(raw))


@dataclass(frozen=True, slots=True)
class MembershipView:
    """One epoch's membership: ``members`` in rank order, plus lookups by role and id.

    Rank order is the order the leader published; existing members keep their relative
    order from epoch to epoch and newcomers are appended, so a removal-only change is a
    shrink and an addition-only change is a grow of the previous communicator.
    """

    epoch: int
    members: tuple[MemberRecord, ...]
    based_on_revision: int = 0
    _by_id: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.epoch, int) or self.epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {self.epoch!r}")
        if self.based_on_revision < 0:
            raise ValueError(f"based_on_revision must be >= 0, got {self.based_on_revision}")
        members = tuple(self.members)
        object.__setattr__(self, "members", members)
        for rank, member in enumerate(members):
            if not isinstance(member, MemberRecord):
                raise ValueError(f"members[{rank}] must be a MemberRecord, got {member!r}")
            if member.member_id in self._by_id:
                raise ValueError(
                    f"member_id {member.member_id!r} appears twice in epoch {self.epoch} "
                    f"(ranks {self._by_id[member.member_id]} and {rank})"
                )
            self._by_id[member.member_id] = rank

    @property
    def num_ranks(self) -> int:
        return len(self.members)

    @property
    def member_ids(self) -> tuple[str, ...]:
        return tuple(m.member_id for m in self.members)

    @property
    def identities(self) -> frozenset[tuple[str, str, str]]:
        return frozenset(m.identity for m in self.members)

    def by_role(self) -> dict[str, tuple[MemberRecord, ...]]:
        """Members grouped by role, each group in rank order (every role present)."""
        return {role: tuple(m for m in self.members if m.role == role) for role in ROLES}

    def members_of(self, role: str) -> tuple[MemberRecord, ...]:
        check_role(role)
        return tuple(m for m in self.members if m.role == role)

    def __contains__(self, member_id: object) -> bool:
        return member_id in self._by_id

    def member(self, member_id: str) -> MemberRecord:
        try:
            return self.members[self._by_id[member_id]]
        except KeyError:
            raise KeyError(
                f"member {member_id!r} is not in epoch {self.epoch} "
                f"(members: {', '.join(self.member_ids) or 'none'})"
            ) from None

    def rank_of(self, member_id: str) -> int:
        """The communicator rank of ``member_id`` in this epoch."""
        self.member(member_id)
        return self._by_id[member_id]

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "members": [m.to_json() for m in self.members],
            "based_on_revision": self.based_on_revision,
        }

    def encode(self) -> bytes:
        """The epoch key's value, column by column (:func:`encode_members`): every member
        decodes it on every epoch and etcd stores, replicates and sends it to every watcher,
        so its size matters: about 50 bytes a member instead of 250 as one JSON object per
        member (1,024 members: ~55 KB instead of ~250 KB; etcd refuses requests over
        1.5 MiB, which the per-member objects passed at ~6,000 ranks)."""
        return json.dumps({"epoch": self.epoch, "based_on_revision": self.based_on_revision,
                           "columns": encode_members(self.members)}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> MembershipView:
        """Either encoding: columns, or one object per member (written before columns)."""
        data = json.loads(raw)
        members = decode_members(data["columns"]) if "columns" in data else \
            tuple(MemberRecord.from_json(m) for m in data["members"])
        return cls(epoch=int(data["epoch"]), members=members, based_on_revision=int(data.get("based_on_revision", 0)))


# Defaults of MemberRecord's optional fields: a column that holds only its default is left out.
_RECORD_DEFAULTS = {"address": "", "state": "ready", "layout_rank": -1, "layout": "", "reform": 0,
                    "reform_epoch": 0, "probe": "", "deltas": False}


def encode_members(members: tuple[MemberRecord, ...]) -> dict[str, Any]:
    """Members as columns (pure): ``{"n": count, field: [values...] | {"of": [distinct
    values], "at": [index per member]}}``. A field whose values repeat (role, host, domain,
    device, layout) stores each distinct value once; a column of defaults is left out."""
    out: dict[str, Any] = {"n": len(members)}
    if not members:
        return out
    for name in members[0].to_json():
        values = [getattr(m, name) for m in members]
        if name in _RECORD_DEFAULTS and all(v == _RECORD_DEFAULTS[name] for v in values):
            continue
        distinct: dict[Any, int] = {}
        for v in values:
            distinct.setdefault(v, len(distinct))
        if len(distinct) * 2 <= len(values):
            out[name] = {"of": list(distinct), "at": [distinct[v] for v in values]}
        else:
            out[name] = values
    return out


def decode_members(columns: Mapping[str, Any]) -> tuple[MemberRecord, ...]:
    """The inverse of :func:`encode_members`."""
    n = int(columns["n"])
    full: dict[str, list[Any]] = {}
    for name, column in columns.items():
        if name == "n":
            continue
        values = [column["of"][i] for i in column["at"]] if isinstance(column, dict) else list(column)
        if len(values) != n:
            raise ValueError(f"epoch column {name!r} has {len(values)} values for {n} members")
        full[name] = values
    return tuple(MemberRecord.from_json({name: values[i] for name, values in full.items()}) for i in range(n))


@dataclass(frozen=True, slots=True)
class ViewDiff:
    """Members present only in the new view (``added``) or only in the old (``removed``).

    A member that restarted (same ``member_id``, new ``incarnation``) is both removed and
    added: its old process and communicator endpoint are gone.
    """

    added: tuple[MemberRecord, ...]
    removed: tuple[MemberRecord, ...]

    @property
    def unchanged(self) -> bool:
        return not self.added and not self.removed

    @property
    def removals_only(self) -> bool:
        return bool(self.removed) and not self.added

    @property
    def additions_only(self) -> bool:
        return bool(self.added) and not self.removed


# The last few diffs by the identity of their (immutable) views: the members of one
# process share each decoded view (one watch, one decode), and each of them asks for the
# same diff on every epoch; O(members) each, so O(members^2) per epoch without this.
_DIFFS: dict[tuple[int, int], tuple[MembershipView | None, MembershipView, ViewDiff]] = {}
_DIFFS_KEPT = 8


def diff(old: MembershipView | None, new: MembershipView) -> ViewDiff:
    """What changed from ``old`` to ``new``; ``old=None`` means everything is added."""
    key = (id(old), id(new))
    hit = _DIFFS.get(key)
    if hit is not None and hit[0] is old and hit[1] is new:
        return hit[2]
    result = _diff(old, new)
    if len(_DIFFS) >= _DIFFS_KEPT:
        _DIFFS.pop(next(iter(_DIFFS)))
    _DIFFS[key] = (old, new, result)  # the views are kept: their ids cannot be reused meanwhile
    return result


def _diff(old: MembershipView | None, new: MembershipView) -> ViewDiff:
    old_ids = old.identities if old is not None else frozenset()
    new_ids = new.identities
    added = tuple(m for m in new.members if m.identity not in old_ids)
    removed = tuple(m for m in old.members if m.identity not in new_ids) if old else ()
    return ViewDiff(added=added, removed=removed)


def needs_new_epoch(current: MembershipView | None, desired: tuple[MemberRecord, ...]) -> bool:
    """Whether ``desired`` (the next member order) calls for an epoch after ``current``:
    members or records changed, except reform requests made before ``current`` reached
    their member (``reform_epoch < current.epoch``): ``current`` already replaced the
    communicator they gave up on. Pure."""
    if not desired:
        return False
    if current is None:
        return True
    if tuple(m.identity for m in desired) != tuple(m.identity for m in current.members):
        return True
    for new, old in zip(desired, current.members, strict=True):
        if new == old:
            continue
        stale_reform = new.reform != old.reform and new.reform_epoch < current.epoch
        if not stale_reform:
            return True
        # Only the reform counter moved (stale): any other change still needs an epoch.
        if replace(new, reform=old.reform, reform_epoch=old.reform_epoch) != old:
            return True
    return False


def next_member_order(
    previous: MembershipView | None, alive: Iterable[MemberRecord]
) -> tuple[MemberRecord, ...]:
    """Rank order for the next epoch: survivors keep their order, newcomers go last.

    Newcomers are sorted by (role, member_id) so every leader computes the same order.
    A survivor's record is taken from ``alive`` (its state or address may have changed).
    """
    alive_by_identity = {m.identity: m for m in alive}
    ordered: list[MemberRecord] = []
    if previous is not None:
        for m in previous.members:
            current = alive_by_identity.pop(m.identity, None)
            if current is not None:
                ordered.append(current)
    newcomers = sorted(alive_by_identity.values(), key=lambda m: (ROLES.index(m.role), m.member_id))
    ordered.extend(newcomers)
    return tuple(ordered)
