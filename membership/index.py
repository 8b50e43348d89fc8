"""The control range indexed once per snapshot, for every member of a process.

A process that hosts many members (a host agent, or the control-plane bench) shares one
watch of the control range among them (:class:`~membership.watch.WatchHub`); on every
change each member looks up leases, suspicions and the leader in it. Scanning the range
per member was O(members) per member and change, O(members^2) for the process; the
index is built once per snapshot (:meth:`~membership.watch.RangeWatcher.derived`) and each
lookup is O(1).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from elastic_refit.membership.client import KeyValue
from elastic_refit.membership.keys import JobKeys
from elastic_refit.membership.liveness import Suspicion
from elastic_refit.membership.watch import RangeSnapshot

from elastic_refit.log import get_logger


@dataclass(frozen=True, slots=True)
class ControlIndex:
    """What a member looks up in the control range on a change, built once per snapshot
    and shared by the members of a process (:meth:`RangeWatcher.derived`): each lookup is
    then O(1) per member, where each member scanning the range was O(members) per member
    and change. ``members``: member id -> (key, key-value) of its member key;
    ``suspicions``: the well-formed suspicions, in key order; ``leader``: the leader key."""

    members: Mapping[str, tuple[str, KeyValue]]
    suspicions: tuple[Suspicion, ...]
    leader: KeyValue | None

    @property
    def member_leases(self) -> Mapping[str, int]:
        """member id -> lease of its member key (a view, no copy)."""
        return _MemberLeases(self.members)


class _MemberLeases(Mapping[str, int]):
    __slots__ = ("_members",)

    def __init__(self, members: Mapping[str, tuple[str, KeyValue]]) -> None:
        self._members = members

    def __getitem__(self, member_id: str) -> int:
        return self._members[member_id][1].lease

    def __iter__(self):
        return iter(self._members)

    def __len__(self) -> int:
        return len(self._members)


def control_index(keys: JobKeys, snap: RangeSnapshot) -> ControlIndex:
    """The :class:`ControlIndex` of a control snapshot (pure)."""
    members: dict[str, tuple[str, KeyValue]] = {}
    suspicions = []
    for key, kv in snap.items.items():
        parsed = keys.parse_member_key(key)
        if parsed is not None:
            members[parsed[1]] = (key, kv)
        elif keys.parse_suspect_key(key) is not None:
            try:
                suspicions.append(Suspicion.decode(kv.value, kv.create_revision))
            except (ValueError, KeyError):
                get_logger(job=keys.job).warning("membership.suspect.bad_record", key=key)
    return ControlIndex(members, tuple(suspicions), snap.items.get(keys.leader))
