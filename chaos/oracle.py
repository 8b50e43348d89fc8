"""The invariant checker: reads members' structured JSON logs, their reports and etcd.

Each check is a pure function of a :class:`TrialEvidence` and returns violations; a
violation has a category that the runner counts:

- ``torn``: a committed version is not bit-exact on a live inference rank (its own
  pattern check failed), replicas acked different digests for one version, or a rank
  served a version that never committed.
- ``lost``: a published version is neither committed nor superseded by a later commit,
  or a surviving member did not reach the last version.
- ``hung``: the trial ran past its deadline, a live member never reported, or a member
  gave up on a timeout.
- ``leaked``: etcd leases outlived every member, processes outlived the trial, or a
  member's process kept TCP sockets, threads or CUDA IPC mappings after it closed.
- ``unsafe``: epochs did not strictly increase, participants of one attempt planned
  different fingerprints, a rank moved bytes / acked / committed in a stale epoch, or a
  member was fenced as a confirmed suspect although no fault killed its process (a false
  positive of the crash detector: stopped, stalled, slow and loaded members keep their
  lease TTL as their bound).
- ``error``: a member that no fault touched failed.

The checks never excuse a fault: a victim (an incarnation a fault fired in) may die or
leave, nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CATEGORIES",
    "TrialEvidence",
    "TrialVerdict",
    "Violation",
    "check_all",
]

CATEGORIES = ("torn", "lost", "hung", "leaked", "unsafe", "error")
# Errors a fault's victim may end with: it was killed (no report), told to leave, or fenced.
VICTIM_ERRORS = ("Terminated", "MembershipLost")
# How every member must end once etcd came back empty (an ``etcd_wipe`` fault).
WIPED_ERROR = "JobStateLost"
# A member that gave up waiting (publish / wait_for_version past their deadline).
TIMEOUT_ERRORS = ("TimeoutError", "RefitTimeout")


@dataclass(frozen=True, slots=True)
class Violation:
    category: str
    check: str
    detail: str

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"category must be one of {CATEGORIES}, got {self.category!r}")


@dataclass(frozen=True)
class TrialEvidence:
    """Everything one trial left behind (incarnation keys are ``member_id-...`` names)."""

    logs: Mapping[str, list[dict[str, Any]]]  # incarnation -> events, in log order, with "_t"
    committed: Mapping[int, dict[str, Any]]  # etcd versions/{v}/committed
    reports: Mapping[str, dict[str, Any]]  # incarnation -> what run_member returned
    last_version: int
    victims: frozenset[str] = frozenset()  # incarnations a fault fired in
    faults: tuple[dict[str, Any], ...] = ()  # fault records (hook side)
    expected_faults: int = 0
    timed_out: bool = False
    deadline_s: float = 0.0
    missing: tuple[str, ...] = ()  # live incarnations that never reported
    leases: tuple[int, ...] = ()  # etcd leases left after the trial settled
    stray_pids: tuple[int, ...] = ()  # processes that outlived the trial
    final: frozenset[str] = frozenset()  # the latest incarnation of each member (must end well)
    # Ended without a report while no fault fired in them -> the worker's exit code. They
    # are among ``victims`` too (gone, so the other checks ask nothing more of them).
    crashed: Mapping[str, int | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.last_version < 1:
            raise ValueError(f"last_version must be >= 1, got {self.last_version}")
        if self.expected_faults < 0 or self.deadline_s < 0:
            raise ValueError(f"expected_faults and deadline_s must be >= 0, got {self.expected_faults}, "
                             f"{self.deadline_s}")


@dataclass(frozen=True, slots=True)
class TrialVerdict:
    violations: tuple[Violation, ...]
    recovery_s: tuple[float, ...] = ()  # per fired fault: fault -> next committed version
    faults_fired: int = 0

    def has(self, category: str) -> bool:
        return any(v.category == category for v in self.violations)

    @property
    def passed(self) -> bool:
        return not self.violations

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "faults_fired": self.faults_fired, "recovery_s": list(self.recovery_s),
                "violations": [{"category": v.category, "check": v.check, "detail": v.detail}
                               for v in self.violations]}


def _events(evidence: TrialEvidence, name: str):
    for incarnation, events in evidence.logs.items():
        for e in events:
            if e.get("event") == name:
                yield incarnation, e


# ---- checks ------------------------------------------------------------------------------
def check_epochs(evidence: TrialEvidence) -> list[Violation]:
    """Every incarnation enters strictly increasing epochs (refit and membership views). A
    process's log holds one incarnation, or several when its member rejoined after a lost
    lease (each event names its own): each is checked on its own."""
    out = []
    for incarnation, events in evidence.logs.items():
        for name in ("refit.epoch.entered", "membership.epoch.changed"):
            last: dict[object, int] = {}
            for e in events:
                if e.get("event") != name or not isinstance(e.get("epoch"), int):
                    continue
                life = e.get("incarnation")
                if life in last and e["epoch"] <= last[life]:
                    out.append(Violation("unsafe", "epochs_increase",
                                         f"{incarnation}: {name} epoch {e['epoch']} after epoch {last[life]}"))
                last[life] = e["epoch"]
    return out


def check_one_plan(evidence: TrialEvidence) -> list[Violation]:
    """One plan per (epoch, attempt): everyone who agreed built the same fingerprint, and
    the coordinator proposed each attempt once."""
    built: dict[tuple[int, int, str], str] = {}
    for incarnation, e in _events(evidence, "refit.plan.built"):
        built[(e.get("epoch"), e.get("seq"), incarnation)] = e.get("fingerprint")
    agreed: dict[tuple[int, int], dict[str, str]] = {}
    for incarnation, e in _events(evidence, "refit.plan.agreed"):
        key = (e.get("epoch"), e.get("seq"))
        agreed.setdefault(key, {})[incarnation] = built.get((key[0], key[1], incarnation), "<none>")
    out = []
    for (epoch, seq), prints in sorted(agreed.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1] or 0)):
        if len(set(prints.values())) > 1:
            out.append(Violation("unsafe", "one_plan",
                                 f"epoch {epoch} attempt {seq}: agreed on different plans {prints}"))
    proposals: dict[tuple[int, int], list[tuple]] = {}
    for incarnation, e in _events(evidence, "refit.attempt.proposed"):
        proposals.setdefault((e.get("epoch"), e.get("seq")), []).append(
            (incarnation, e.get("version"), e.get("kind"), e.get("sources"), e.get("destinations")))
    for key, props in proposals.items():
        if len({p[1:] for p in props}) > 1:
            out.append(Violation("unsafe", "one_plan", f"epoch {key[0]} attempt {key[1]} proposed twice: {props}"))
    return out


def check_no_stale_epoch(evidence: TrialEvidence) -> list[Violation]:
    """No rank moves bytes, acks or commits under an epoch older than the newest it entered;
    commits (etcd) never go back in epoch as versions increase."""
    out = []
    for incarnation, events in evidence.logs.items():
        newest = None
        for e in events:
            name = e.get("event")
            epoch = e.get("epoch")
            if name == "refit.epoch.entered" and isinstance(epoch, int):
                newest = epoch if newest is None else max(newest, epoch)
            elif (name in ("refit.transfer.done", "refit.version.acked", "refit.version.committed",
                           "refit.plan.agreed") and isinstance(epoch, int)
                  and (newest is None or epoch < newest)):
                    out.append(Violation("unsafe", "no_stale_epoch",
                                         f"{incarnation}: {name} (version {e.get('version')}) in epoch {epoch} "
                                         f"while its newest epoch is {newest}"))
    last_epoch, last_version = None, None
    for version in sorted(evidence.committed):
        epoch = evidence.committed[version].get("epoch")
        if last_epoch is not None and isinstance(epoch, int) and epoch < last_epoch:
            out.append(Violation("unsafe", "no_stale_epoch",
                                 f"version {version} committed in epoch {epoch} after version {last_version} "
                                 f"in epoch {last_epoch}"))
        last_epoch, last_version = epoch, version
    return out


def check_bit_exact(evidence: TrialEvidence) -> list[Violation]:
    """Every committed version served is bit-exact: members' own pattern checks, one ack
    digest per (version, layout rank), and nothing served that did not commit."""
    out = []
    for incarnation, report in evidence.reports.items():
        for problem in report.get("problems") or ():
            out.append(Violation("torn", "bit_exact", f"{incarnation}: {problem}"))
        for c in report.get("committed") or ():
            if c.get("verified") is False:
                out.append(Violation("torn", "bit_exact", f"{incarnation}: version {c.get('version')} not verified"))
    layout_rank = {}
    for incarnation, e in _events(evidence, "refit.member.started"):
        layout_rank[incarnation] = e.get("layout_rank")
    digests: dict[tuple[int, Any], dict[str, str]] = {}
    for incarnation, e in _events(evidence, "refit.version.acked"):
        key = (e.get("version"), layout_rank.get(incarnation))
        digests.setdefault(key, {})[incarnation] = e.get("digest")
    for (version, rank), by in sorted(digests.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1] or 0)):
        if len(set(by.values())) > 1:
            out.append(Violation("torn", "ack_digests", f"version {version} layout rank {rank}: acks differ {by}"))
    for incarnation, e in _events(evidence, "refit.version.serving"):
        if e.get("version") not in evidence.committed:
            out.append(Violation("torn", "serves_committed",
                                 f"{incarnation} served version {e.get('version')}, which never committed"))
    return out


def wiped_at(evidence: TrialEvidence) -> float | None:
    """When an ``etcd_wipe`` fault fired (its record's time), None if none did."""
    times = [f["t"] for f in evidence.faults if f.get("kind") == "etcd_wipe" and isinstance(f.get("t"), int | float)]
    return min(times) if times else None


def check_stopped_on_wipe(evidence: TrialEvidence) -> list[Violation]:
    """Once etcd came back empty, the job's state is gone: every member stops with
    ``JobStateLost`` and nothing commits or is served after the wipe (DESIGN.md, invariant
    5: versions only move forward, also across an etcd restored from an empty state)."""
    wiped = wiped_at(evidence)
    if wiped is None:
        return []
    out = []
    for incarnation, report in sorted(evidence.reports.items()):
        if report.get("error_type") != WIPED_ERROR:
            out.append(Violation("unsafe", "stops_on_wipe", f"{incarnation} went on after etcd was wiped "
                                                            f"({report.get('error_type') or 'no error'})"))
    for name in ("refit.version.committed", "refit.version.serving"):
        for incarnation, e in _events(evidence, name):
            if isinstance(e.get("_t"), int | float) and e["_t"] > wiped + 0.5:  # 0.5 s: the fault record's own lag
                out.append(Violation("unsafe", "stops_on_wipe", f"{incarnation}: {name} version {e.get('version')} "
                                                                f"{e['_t'] - wiped:.2f} s after etcd was wiped"))
    return out


def check_no_version_lost(evidence: TrialEvidence) -> list[Violation]:
    """Every published version is committed or superseded by a later commit; the last
    version commits; every member that ended well reached it. (After a wipe nothing may
    commit: ``check_stopped_on_wipe``.)"""
    if wiped_at(evidence) is not None:
        return []
    out = []
    latest = max(evidence.committed, default=None)
    published = {e.get("version") for _, e in _events(evidence, "refit.version.published")}
    for version in sorted(v for v in published if isinstance(v, int)):
        if version not in evidence.committed and (latest is None or latest < version):
            out.append(Violation("lost", "no_version_lost", f"version {version} was published and never committed"))
    if evidence.last_version not in evidence.committed:
        out.append(Violation("lost", "no_version_lost", f"the last version {evidence.last_version} never committed"))
    for incarnation in sorted(evidence.final):
        report = evidence.reports.get(incarnation)
        if report is None or report.get("error_type"):
            continue  # counted by check_members / check_hung
        seen = [c.get("version") for c in report.get("committed") or ()]
        if not seen or max(v for v in seen if v is not None) < evidence.last_version:
            out.append(Violation("lost", "reached_last", f"{incarnation} stopped at versions {seen}"))
    return out


def check_hung(evidence: TrialEvidence) -> list[Violation]:
    """Nothing hangs past its timeout."""
    out = []
    if evidence.timed_out:
        out.append(Violation("hung", "deadline", f"trial ran past its {evidence.deadline_s:.0f} s deadline"))
    for incarnation in evidence.missing:
        out.append(Violation("hung", "reported", f"{incarnation} never reported"))
    for incarnation, report in evidence.reports.items():
        if report.get("error_type") in TIMEOUT_ERRORS and incarnation not in evidence.victims:
            out.append(Violation("hung", "timeout", f"{incarnation}: {str(report.get('error'))[:200]}"))
    return out


def check_no_crash(evidence: TrialEvidence) -> list[Violation]:
    """Only a fault's victim may end without a report: any other process that ended (a
    segfault in a library's teardown, an ``os._exit``) is an error named with its exit code,
    never a silent "gone" (its peers would see a death no fault caused)."""
    return [Violation("error", "crashed", f"{incarnation}: its process ended without a report (exit code "
                                          f"{code}) and no fault fired in it")
            for incarnation, code in sorted(evidence.crashed.items())]


def check_members(evidence: TrialEvidence) -> list[Violation]:
    """Members no fault touched end without an error; victims end only as a fault allows."""
    out = []
    for incarnation, report in evidence.reports.items():
        kind = report.get("error_type")
        if not kind or (kind in TIMEOUT_ERRORS and incarnation not in evidence.victims):
            continue
        if incarnation in evidence.victims and kind in VICTIM_ERRORS:
            continue
        if kind == WIPED_ERROR and wiped_at(evidence) is not None:
            continue  # what check_stopped_on_wipe asks of every member
        out.append(Violation("error", "members", f"{incarnation}: {kind}: {str(report.get('error'))[:300]}"))
    return out


# Faults that end the victim's process: only their victims may be fenced as confirmed
# suspects (SIGKILL closes every socket of the process at once).
_KILLING_FAULTS = ("kill", "restart")


def killed_incarnations(evidence: TrialEvidence) -> frozenset[str]:
    """Incarnations a killing fault fired in (fault records name member and life; an
    incarnation is ``{member_id}-L{life}-...``)."""
    prefixes = {f"{f.get('member_id')}-L{f.get('life', 0)}-" for f in evidence.faults
                if f.get("kind") in _KILLING_FAULTS}
    return frozenset(inc for inc in evidence.logs if any(inc.startswith(p) for p in prefixes))


def check_no_live_member_fenced(evidence: TrialEvidence) -> list[Violation]:
    """Every member fenced as a confirmed suspect (``membership.suspect.confirmed``) was an
    incarnation a fault killed: a live member (slow, stopped, loaded) is never fenced."""
    killed = killed_incarnations(evidence)
    out = []
    for incarnation, e in _events(evidence, "membership.suspect.confirmed"):
        suspect = e.get("incarnation")
        if suspect not in killed:
            out.append(Violation("unsafe", "no_live_member_fenced",
                                 f"{incarnation} fenced {e.get('suspect')} (incarnation {suspect}, evidence "
                                 f"{e.get('evidence')}), which no fault killed"))
    return out


# What a member may still hold after its close: (report key, check, what it is, how many a
# violation quotes).
_MEMBER_LEFTOVERS = (
    ("leftover_sockets", "sockets", "TCP sockets", 4),
    ("leftover_threads", "threads", "threads", 6),
    ("leftover_ipc_mappings", "ipc_mappings", "other processes' GPU memory mapped (CUDA IPC)", 4),
)


def check_leaks(evidence: TrialEvidence) -> list[Violation]:
    """No etcd lease, child process, socket, thread or IPC mapping outlives its owner."""
    out = []
    if evidence.leases:
        out.append(Violation("leaked", "leases", f"etcd leases {list(evidence.leases)} outlived every member"))
    if evidence.stray_pids:
        out.append(Violation("leaked", "processes", f"processes {list(evidence.stray_pids)} outlived the trial"))
    for incarnation, report in evidence.reports.items():
        for key, check, what, quoted in _MEMBER_LEFTOVERS:
            if report.get(key):
                holders = report.get(f"{key}_holders")
                why = f" (held by: {holders})" if holders else ""
                out.append(Violation("leaked", check,
                                     f"{incarnation} kept {what} after close: {report[key][:quoted]}{why}"))
    return out


def check_faults_fired(evidence: TrialEvidence) -> list[Violation]:
    """A trial whose faults did not all fire tested less than it claims (reported, so a
    matrix cell that never fires is visible, as an error)."""
    fired = {f.get("index") for f in evidence.faults}
    if len(fired) < evidence.expected_faults:
        return [Violation("error", "faults_fired",
                          f"only {len(fired)} of {evidence.expected_faults} faults fired")]
    return []


CHECKS = (check_epochs, check_one_plan, check_no_stale_epoch, check_bit_exact, check_no_version_lost,
          check_hung, check_members, check_leaks, check_faults_fired, check_no_live_member_fenced,
          check_stopped_on_wipe, check_no_crash)


def recovery_times(evidence: TrialEvidence) -> list[float]:
    """Per fired fault: seconds from the fault to the next ``refit.version.committed``."""
    commits = sorted(e["_t"] for _, e in _events(evidence, "refit.version.committed") if e.get("_t"))
    out = []
    for f in evidence.faults:
        after = [t for t in commits if t > f["t"]]
        if after:
            out.append(after[0] - f["t"])
    return out


def check_all(evidence: TrialEvidence) -> TrialVerdict:
    """Run every check; the verdict lists violations and recovery times."""
    violations: list[Violation] = []
    for check in CHECKS:
        violations += check(evidence)
    return TrialVerdict(tuple(violations), tuple(recovery_times(evidence)),
                        len({f.get("index") for f in evidence.faults}))
