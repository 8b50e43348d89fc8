"""The etcd key layout of one job (DESIGN.md, "Membership on etcd").

Everything lives under ``/elastic-refit/{job}/``; only this module spells key names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from elastic_refit._validate import require_at_least

ROLES: tuple[str, ...] = ("trainer", "inference")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_name(kind: str, value: str) -> str:
    """Return ``value`` if it is a safe key component, else raise ``ValueError``."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(
            f"{kind} must match {_NAME.pattern} (letters, digits, '_', '.', '-'), got {value!r}"
        )
    return value


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return role


@dataclass(frozen=True, slots=True)
class JobKeys:
    """Key names of one job: ``JobKeys("job1").member("trainer", "t0")``."""

    job: str

    def __post_init__(self) -> None:
        check_name("job", self.job)

    @property
    def prefix(self) -> str:
        return f"/elastic-refit/{self.job}/"

    @property
    def members_prefix(self) -> str:
        return self.prefix + "members/"

    def members_of(self, role: str) -> str:
        return f"{self.members_prefix}{check_role(role)}/"

    def member(self, role: str, member_id: str) -> str:
        return self.members_of(role) + check_name("member_id", member_id)

    @property
    def leader(self) -> str:
        return self.prefix + "leader"

    @property
    def suspects_prefix(self) -> str:
        """``health/suspects/``: inside the control range ('e' < 'h' < 'l' < 'm'), so the
        one control watch every member already holds carries suspicions and refutations
        (no extra stream per member, none per pair)."""
        return self.prefix + "health/suspects/"

    def suspect(self, member_id: str) -> str:
        """A suspicion that ``member_id`` died, on the reporter's lease: JSON ``{lease,
        incarnation, reporter, reporter_lease, evidence, detail}`` (``lease``: the suspect's
        lease the suspicion is about). Created only if absent; the suspect deletes it to
        refute, the confirmer deletes it with the suspect's member key to fence."""
        return self.suspects_prefix + check_name("member_id", member_id)

    def parse_suspect_key(self, key: str) -> str | None:
        """The suspect's member id of a suspicion key, else ``None``."""
        if not key.startswith(self.suspects_prefix):
            return None
        rest = key[len(self.suspects_prefix):]
        return rest if rest and "/" not in rest else None

    @property
    def epoch(self) -> str:
        return self.prefix + "epoch"

    @property
    def run(self) -> str:
        """``run``: the job's run (JSON ``{run_id, instance, started}``, see
        ``membership.run``), created once, when the job's first member registers, never on a
        lease: a member that finds another run instance (or none) when it registers again
        knows the job's control state in etcd was replaced (etcd wiped, or restored from
        another state)."""
        return self.prefix + "run"

    @property
    def store_root(self) -> str:
        return self.prefix + "store/"

    def store(self, epoch: int) -> str:
        require_at_least("epoch", epoch, 0)
        return f"{self.store_root}{epoch}/"

    @property
    def layouts_prefix(self) -> str:
        return self.prefix + "layouts/"

    def layout(self, fingerprint: str) -> str:
        """A side's self-described layout, content-addressed: a header naming its chunks."""
        return self.layouts_prefix + check_name("layout fingerprint", fingerprint)

    def layout_chunk(self, fingerprint: str, index: int) -> str:
        require_at_least("layout chunk", index, 0)
        return f"{self.layout(fingerprint)}/{index:06d}"

    @property
    def versions_prefix(self) -> str:
        return self.prefix + "versions/"

    def version(self, version: int) -> str:
        require_at_least("version", version, 0)
        return f"{self.versions_prefix}{version}/"

    def sources(self, version: int) -> str:
        """Prefix of every trainer's source key of ``version``."""
        return f"{self.version(version)}sources/"

    def acks(self, version: int) -> str:
        """Prefix of every inference rank's ack of ``version``."""
        return f"{self.version(version)}acks/"

    def source(self, version: int, member_id: str) -> str:
        return f"{self.sources(version)}{check_name('member_id', member_id)}"

    def ack(self, version: int, member_id: str) -> str:
        return f"{self.acks(version)}{check_name('member_id', member_id)}"

    def committed(self, version: int) -> str:
        return f"{self.version(version)}committed"

    def failed(self, version: int) -> str:
        """``{version, cause, num_attempts, epoch}``: ``version`` was given up after failing
        that many consecutive attempts for one cause (created once, like ``committed``)."""
        return f"{self.version(version)}failed"

    def attempt(self, epoch: int, seq: int) -> str:
        """The attempt ``seq`` the coordinator of ``epoch`` proposed (purged with the epoch,
        and by the coordinator once two later attempts finished). Zero-padded: attempts sort
        in order, so the first one at or after a seq is one range read."""
        return f"{self.attempts(epoch)}{seq:08d}"

    def attempts(self, epoch: int) -> str:
        """Prefix of every attempt record of ``epoch``."""
        return f"{self.store(epoch)}attempts/"

    def parse_attempt_key(self, key: str) -> tuple[int, int] | None:
        """``(epoch, seq)`` of an attempt record's key (:meth:`attempt`), else ``None``."""
        if not key.startswith(self.store_root):
            return None
        parts = key[len(self.store_root):].split("/")
        if len(parts) != 3 or parts[1] != "attempts" or not parts[0].isdigit() or not parts[2].isdigit():
            return None
        return int(parts[0]), int(parts[2])

    def parse_done_key(self, key: str) -> tuple[int, int, str] | None:
        """``(epoch, seq, member_id)`` of a participant's ``done`` key of an attempt
        (:meth:`AttemptKeys.done` inside the epoch's store), else ``None``."""
        if not key.startswith(self.store_root):
            return None
        parts = key[len(self.store_root):].split("/")
        if (len(parts) != 5 or parts[1] != "attempt" or parts[3] != "done" or not parts[0].isdigit()
                or not parts[2].isdigit()):
            return None
        return int(parts[0]), int(parts[2]), parts[4]

    def parse_version_key(self, key: str) -> tuple[int, str, str | None] | None:
        """``(version, kind, member_id)`` of a key under ``versions/`` (kind ``sources``,
        ``acks``, ``committed`` or ``failed``; member_id None for the last two), else ``None``."""
        if not key.startswith(self.versions_prefix):
            return None
        parts = key[len(self.versions_prefix):].split("/")
        if not parts[0].isdigit():
            return None
        if len(parts) == 3 and parts[1] in ("sources", "acks"):
            return int(parts[0]), parts[1], parts[2]
        if len(parts) == 2 and parts[1] in ("committed", "failed"):
            return int(parts[0]), parts[1], None
        return None

    @property
    def control_range(self) -> tuple[str, str]:
        """``[start, end)`` covering ``epoch``, ``health/suspects/...``, ``leader`` and
        ``members/...`` (and ``layouts/...``, which sorts among them).

        These keys sort together ('e' < 'h' < 'l' < 'm'), so one watch stream carries all
        control-plane changes and none of the store or version traffic.
        """
        return self.epoch, self.prefix + "members0"  # '0' sorts right after '/'

    def parse_member_key(self, key: str) -> tuple[str, str] | None:
        """``(role, member_id)`` for a member key of this job, else ``None``."""
        if not key.startswith(self.members_prefix):
            return None
        rest = key[len(self.members_prefix) :].split("/")
        if len(rest) != 2 or rest[0] not in ROLES:
            return None
        return rest[0], rest[1]


@dataclass(frozen=True, slots=True)
class AttemptKeys:
    """Keys of one attempt inside an epoch's rendezvous store (relative to ``store/{epoch}/``)."""

    seq: int

    def __post_init__(self) -> None:
        require_at_least("attempt seq", self.seq, 0)

    def plan(self, member_id: str) -> str:
        """The plan fingerprint ``member_id`` computed (or, when it failed before planning,
        its ``done`` value: ``failed: <cause>`` or ``aborted: <reason>``)."""
        return f"attempt/{self.seq}/plan/{check_name('member_id', member_id)}"

    @property
    def prefix(self) -> str:
        """Every participant's key of this attempt (plan and done)."""
        return f"attempt/{self.seq}/"

    def done(self, member_id: str) -> str:
        """``ok``, ``failed: <cause>`` (a fault of this member's own) or ``aborted: <reason>``
        (it stopped because a peer failed first, the epoch moved on, or etcd or its lease
        failed): ``member_id`` finished the attempt."""
        return f"attempt/{self.seq}/done/{check_name('member_id', member_id)}"


def connect_key(member_id: str) -> str:
    """The fingerprint of the plan whose pairs ``member_id`` connects on entering the epoch
    (or ``skip: <cause>``), inside the epoch's rendezvous store."""
    return f"connect/{check_name('member_id', member_id)}"
