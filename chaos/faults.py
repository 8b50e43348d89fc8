"""Fault plans: what breaks, where in the refit protocol, and when; seeded and reproducible.

A :class:`Fault` names a victim (a role and a rank within that role, ``"any"`` for whoever
reaches the phase first: the epoch's coordinator for ``commit``), a fault kind, the named
phase it fires at and the weight version it waits for. A :class:`FaultPlan` is an ordered
tuple of faults; a fault may wait for an earlier one to have fired (``after``: a second
fault during recovery) and may target a restarted incarnation (``life``: 1 is the first
restart, so ``at="rejoin", life=1`` hits a restarted rank as it re-enters the job).

Phases (chaos vocabulary -> runtime hook):

=====================  ==========================================================
``attempt.start``      an attempt begins on a participant
``plan.agreed``        every participant agreed on the plan's fingerprint
``comm.reconfiguring`` the communicator of a new epoch is being built
``comm.ready``         the communicator of a new epoch is ready
``transfer``           transfer message ``chunk`` (0-based) of this rank's ``n``
``ack.before``         the bytes arrived and verified, the ack is not yet written
``commit``             the coordinator is about to commit a version
``rejoin``             a restarted rank builds its first communicator
=====================  ==========================================================

:func:`build_matrix` turns a matrix name, a trial count and a seed into concrete
:class:`Scenario` objects; the same arguments always give the same scenarios.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from elastic_refit._validate import require_at_least
from elastic_refit.runtime.settings import Timeouts

__all__ = [
    "DELTA_CONFIG",
    "FAULT_KINDS",
    "PHASES",
    "ROLES",
    "Fault",
    "FaultPlan",
    "Scenario",
    "build_matrix",
    "matrix_fault_names",
    "no_fault_scenarios",
    "runtime_phase",
    "with_deltas",
]

ROLES = ("trainer", "inference", "any", "etcd")
PHASES = ("attempt.start", "plan.agreed", "comm.reconfiguring", "comm.ready", "transfer", "ack.before",
          "commit", "rejoin")
# kill: SIGKILL; restart: SIGKILL then a new incarnation at once (inside the old lease's
# TTL); terminate: SIGTERM (graceful leave); stop: SIGSTOP for duration_s then SIGCONT
# (longer than the TTL: the rank is dropped and fenced; shorter: keepalive starvation it
# survives); stall: the agent thread blocks for duration_s (keepalives continue); slow:
# every transfer message is delayed by duration_s; etcd_restart: etcd is SIGKILLed for
# duration_s and restarted while the victim sits in the phase; etcd_stall: every etcd node
# is SIGSTOPped for duration_s (longer than the TTL: every lease expires, and each member
# comes back as a new incarnation in its own process); etcd_wipe: etcd is SIGKILLed and,
# after duration_s, started again with an empty data directory (every member must stop
# with a clear error, nothing served out of order).
FAULT_KINDS = ("kill", "restart", "terminate", "stop", "stall", "slow", "etcd_restart", "etcd_stall", "etcd_wipe")
# The parent does them to etcd while the victim waits in the phase.
ETCD_FAULTS = ("etcd_restart", "etcd_stall", "etcd_wipe")
_RUNTIME_PHASE = {"transfer": "transfer.before", "commit": "commit.before", "rejoin": "comm.reconfiguring"}


def runtime_phase(phase: str) -> str:
    """The runtime hook name (``ElasticRefit._hook``) a chaos phase fires at."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    return _RUNTIME_PHASE.get(phase, phase)


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault: ``kind`` hits ``role`` rank ``rank`` at ``at`` of ``version``."""

    kind: str
    role: str
    at: str
    rank: int | None = None  # index within the role (t0, t1 / i0, i1); None: the first to get there
    version: int | None = None  # None: the first time the phase is reached (comm phases: the nth)
    chunk: int = 0  # transfer: messages that complete before the fault
    nth: int = 1  # comm phases without a version: fire on the nth time the phase is reached
    duration_s: float = 0.0  # stop / stall length, slow delay per message, etcd downtime
    restart: bool = False  # start a new incarnation of the victim after the fault
    restart_delay_s: float = 0.0
    after: int | None = None  # index (in the plan) of a fault that must have fired first
    life: int = 0  # which incarnation of the victim: 0 the first, 1 the first restart, ...

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        runtime_phase(self.at)
        if self.rank is not None and self.rank < 0:
            raise ValueError(f"rank must be >= 0 or None, got {self.rank}")
        if self.version is not None and self.version < 1:
            raise ValueError(f"version must be >= 1 or None, got {self.version}")
        if self.chunk < 0 or self.nth < 1 or self.life < 0:
            raise ValueError(f"chunk >= 0, nth >= 1 and life >= 0 required, got {self.chunk}, {self.nth}, {self.life}")
        if self.duration_s < 0 or self.restart_delay_s < 0:
            raise ValueError(f"durations must be >= 0, got {self.duration_s}, {self.restart_delay_s}")
        if self.kind in ("stop", "stall", "slow", *ETCD_FAULTS) and self.duration_s <= 0:
            raise ValueError(f"a {self.kind} fault needs duration_s > 0, got {self.duration_s}")
        if self.kind == "restart" and not self.restart:
            object.__setattr__(self, "restart", True)
        if self.at == "commit" and self.role not in ("any", "etcd"):
            # Only the epoch's coordinator commits; which member that is depends on join order.
            raise ValueError(f"phase 'commit' is reached by the coordinator only: use role 'any', got {self.role!r}")
        if self.at == "rejoin" and self.life < 1:
            raise ValueError(f"phase 'rejoin' needs a restarted incarnation (life >= 1), got life={self.life}")
        if self.after is not None and self.after < 0:
            raise ValueError(f"after must be a fault index >= 0, got {self.after}")

    @property
    def victim(self) -> str | None:
        """Member id of the victim (``t1``, ``i0``), None for "first to get there"."""
        if self.rank is None or self.role in ("any", "etcd"):
            return None
        return f"{'t' if self.role == 'trainer' else 'i'}{self.rank}"

    @property
    def label(self) -> str:
        """Short phase label for tables (``transfer[2]``, ``rejoin``)."""
        return f"transfer[{self.chunk}]" if self.at == "transfer" else self.at

    def matches_member(self, role: str, member_id: str) -> bool:
        """Whether this fault may fire in member ``member_id`` (role ``role``)."""
        if self.role == "etcd":
            return self.rank is None or member_id == f"i{self.rank}" or member_id == f"t{self.rank}"
        if self.role != "any" and self.role != role:
            return False
        return self.victim is None or self.victim == member_id


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """An ordered tuple of faults, built fluently: ``FaultPlan().kill(role="inference",
    rank=1, at="transfer", version=2)``. Each builder returns a new plan."""

    faults: tuple[Fault, ...] = ()

    def __post_init__(self) -> None:
        for i, f in enumerate(self.faults):
            if not isinstance(f, Fault):
                raise ValueError(f"faults[{i}] must be a Fault, got {f!r}")
            if f.after is not None and f.after >= i:
                raise ValueError(f"faults[{i}].after={f.after} must name an earlier fault")

    def add(self, fault: Fault) -> FaultPlan:
        return FaultPlan(self.faults + (fault,))

    def kill(self, *, role: str, at: str, rank: int | None = None, version: int | None = None, **kw) -> FaultPlan:
        """SIGKILL the victim at ``at`` (``restart=True``: a supervisor starts it again)."""
        return self.add(Fault("kill", role, at, rank, version, **kw))

    def restart(self, *, role: str, at: str, rank: int | None = None, version: int | None = None,
                **kw) -> FaultPlan:
        """SIGKILL, then a new incarnation starts at once, inside the old lease's TTL."""
        return self.add(Fault("restart", role, at, rank, version, restart=True, **kw))

    def terminate(self, *, role: str, at: str, rank: int | None = None, version: int | None = None,
                  **kw) -> FaultPlan:
        """SIGTERM: the rank leaves gracefully (closes, revokes its lease)."""
        return self.add(Fault("terminate", role, at, rank, version, **kw))

    def stop(self, *, role: str, at: str, duration_s: float, rank: int | None = None,
             version: int | None = None, **kw) -> FaultPlan:
        """SIGSTOP for ``duration_s`` then SIGCONT (longer than the TTL: dropped and fenced)."""
        return self.add(Fault("stop", role, at, rank, version, duration_s=duration_s, **kw))

    def stall(self, *, role: str, at: str, duration_s: float, rank: int | None = None,
              version: int | None = None, **kw) -> FaultPlan:
        """Block the rank's agent thread for ``duration_s`` (its keepalives continue)."""
        return self.add(Fault("stall", role, at, rank, version, duration_s=duration_s, **kw))

    def slow(self, *, role: str, duration_s: float, rank: int | None = None, version: int | None = None,
             **kw) -> FaultPlan:
        """Delay every transfer message of the rank by ``duration_s``."""
        return self.add(Fault("slow", role, "transfer", rank, version, duration_s=duration_s, **kw))

    def etcd_restart(self, *, at: str, duration_s: float, role: str = "etcd", rank: int | None = None,
                     version: int | None = None, **kw) -> FaultPlan:
        """SIGKILL etcd while a member (``rank``: ``t``/``i`` index, None: any) is at ``at``;
        restart it after ``duration_s``."""
        return self.add(Fault("etcd_restart", role, at, rank, version, duration_s=duration_s, **kw))

    def etcd_stall(self, *, at: str, duration_s: float, role: str = "etcd", rank: int | None = None,
                   version: int | None = None, **kw) -> FaultPlan:
        """SIGSTOP every etcd node while a member is at ``at``; SIGCONT after ``duration_s``."""
        return self.add(Fault("etcd_stall", role, at, rank, version, duration_s=duration_s, **kw))

    def etcd_wipe(self, *, at: str, duration_s: float, role: str = "etcd", rank: int | None = None,
                  version: int | None = None, **kw) -> FaultPlan:
        """SIGKILL etcd while a member is at ``at``; after ``duration_s`` start it again empty."""
        return self.add(Fault("etcd_wipe", role, at, rank, version, duration_s=duration_s, **kw))

    def __len__(self) -> int:
        return len(self.faults)


@dataclass(frozen=True, slots=True)
class Scenario:
    """One trial's set-up: the fault plan and the job's shape."""

    name: str  # victim x fault x phase, the table's row key
    victim: str
    fault: str
    phase: str
    plan: FaultPlan
    seed: int
    versions: int = 3
    num_inference: int = 2
    etcd_nodes: int = 1
    quick_excluded: str | None = field(default=None, compare=False)  # why it is not in the quick matrix
    spec_json: str | None = field(default=None, compare=False)  # the job's layouts (default: the trial model)
    trainer_pause_s: float = 0.3  # trainers: time between versions (a training step)
    member_config: Mapping[str, Any] | None = field(default=None, compare=False)  # RefitConfig overrides
    # Deltas' trials: version k changes about this fraction of version k - 1's elements
    # (``testing.versions``) instead of being new data throughout (see :func:`with_deltas`).
    delta_density: float | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        require_at_least("versions", self.versions, 2, "a fault needs a version after it")
        require_at_least("num_inference", self.num_inference, 2, "replicas make recovery possible")
        if self.etcd_nodes not in (1, 3):
            raise ValueError(f"etcd_nodes must be 1 or 3, got {self.etcd_nodes}")
        require_at_least("trainer_pause_s", self.trainer_pause_s, 0)


TTL_S = float(Timeouts().ttl_s)  # the members' lease TTL (RefitConfig default); stop durations are chosen around it
# How long a member's peers wait on it mid-transfer (RefitConfig.transport_timeout_s).
PEER_TIMEOUT_S = TTL_S + 1.0
# stall>ttl: the agent blocks past the lease TTL (a lease renewed by the agent would lapse:
# the keeper thread must hold it) and ends well before the peers' timeout, so they always
# wait it out. A stall of TTL + 1 s ended with that timeout: whichever came first decided
# between a recovery of ~3.05 s and one of 3.3-3.44 s (the peers reform, rebuild and retry),
# 0.06 s inside TTL + 1.5 s.
STALL_S = TTL_S + 0.5


# Longer than a trial's remaining refits (they run on two etcd nodes) and than two TTLs (the
# leases are renewed through the other nodes meanwhile).
ETCD_MEMBER_DOWN_S = max(6.0, 2 * TTL_S + 1.0)


def _templates(rng: random.Random, versions: int, etcd_nodes: int = 1) -> list[tuple[str, str, str, FaultPlan]]:
    """Every (victim, fault, phase) cell with its plan; ``rng`` picks versions, ranks, chunks."""

    def v() -> int:
        return rng.randint(2, versions)

    def chunk() -> int:
        return rng.randint(0, 2)

    out: list[tuple[str, str, str, FaultPlan]] = []
    for role in ("trainer", "inference"):
        victim = role
        rank = rng.randint(0, 1)
        for at in ("plan.agreed", "transfer", "ack.before", "attempt.start"):
            if at == "ack.before" and role == "trainer":
                continue  # trainers never ack
            k = chunk() if at == "transfer" else 0
            label = f"transfer[{k}]" if at == "transfer" else at
            out.append((victim, "kill", label, FaultPlan().kill(role=role, rank=rank, at=at, version=v(), chunk=k)))
        for at in ("comm.reconfiguring", "comm.ready"):
            out.append((victim, "kill", at, FaultPlan().kill(role=role, rank=rank, at=at)))
        k = chunk()
        out.append((victim, "restart<ttl", f"transfer[{k}]",
                    FaultPlan().restart(role=role, rank=rank, at="transfer", version=v(), chunk=k)))
        out.append((victim, "restart<ttl", "plan.agreed",
                    FaultPlan().restart(role=role, rank=rank, at="plan.agreed", version=v())))
        out.append((victim, "terminate", "transfer[0]",
                    FaultPlan().terminate(role=role, rank=rank, at="transfer", version=v())))
        out.append((victim, "stop>ttl", "transfer[0]",
                    FaultPlan().stop(role=role, rank=rank, at="transfer", version=v(),
                                     duration_s=TTL_S + 1.5, restart=True)))
        out.append((victim, "stop<ttl", "plan.agreed",
                    FaultPlan().stop(role=role, rank=rank, at="plan.agreed", version=v(), duration_s=TTL_S / 2)))
        out.append((victim, "stall>ttl", "plan.agreed",
                    FaultPlan().stall(role=role, rank=rank, at="plan.agreed", version=v(), duration_s=STALL_S)))
        out.append((victim, "slow", "transfer",
                    FaultPlan().slow(role=role, rank=rank, version=v(), duration_s=0.2)))
        # A second fault during recovery: the other role's rank dies while the job re-forms.
        other = "inference" if role == "trainer" else "trainer"
        out.append((victim, "kill+kill", "transfer>reconfiguring",
                    FaultPlan().kill(role=role, rank=rank, at="transfer", version=v())
                    .kill(role=other, rank=rng.randint(0, 1), at="comm.reconfiguring", after=0)))
        out.append((victim, "kill+kill", "transfer>plan.agreed",
                    FaultPlan().kill(role=role, rank=rank, at="transfer", version=v(), restart=True)
                    .kill(role=other, rank=rng.randint(0, 1), at="plan.agreed", after=0)))
        # The restarted rank dies again as it rejoins, and comes back once more.
        out.append((victim, "restart+kill", "rejoin",
                    FaultPlan().restart(role=role, rank=rank, at="transfer", version=v())
                    .kill(role=role, rank=rank, at="rejoin", life=1, after=0, restart=True)))
    out.append(("coordinator", "kill", "commit", FaultPlan().kill(role="any", at="commit", version=v(), restart=True)))
    out.append(("coordinator", "restart<ttl", "commit", FaultPlan().restart(role="any", at="commit", version=v())))
    for at in ("plan.agreed", "transfer", "commit"):
        # Down 0.3 s (+ restart ~0.5-1 s): the outage stays inside the lease TTL.
        out.append(("etcd", "etcd_restart<ttl", at,
                    FaultPlan().etcd_restart(at=at, version=v(), duration_s=0.3)))
    out.append(("etcd", "etcd_restart~ttl", "transfer",
                FaultPlan().etcd_restart(at="transfer", version=v(), duration_s=1.0)))
    # etcd stalls past the TTL (a GC pause, a VM hiccup): every lease expires; every member
    # rejoins as a new incarnation, no process restarts, and the job goes on.
    for ttls, at in ((2, "transfer"), (5, "plan.agreed")):
        out.append(("etcd", f"etcd_stall{ttls}x>ttl", at,
                    FaultPlan().etcd_stall(at=at, version=v(), duration_s=ttls * TTL_S)))
    # etcd comes back empty (a lost data directory): the job's state is gone; every member
    # stops with JobStateLost, none commits or serves anything after it.
    out.append(("etcd", "etcd_wipe", "transfer", FaultPlan().etcd_wipe(at="transfer", version=v(), duration_s=0.3)))
    if etcd_nodes > 1:
        # The raft leader is killed mid-transfer and stays down while the job refits through
        # the quorum left (the runner restarts it once the trial's versions are in).
        for at in ("transfer", "commit"):
            out.append(("etcd", "etcd_member_down", at,
                        FaultPlan().etcd_restart(at=at, version=v(), duration_s=ETCD_MEMBER_DOWN_S)))
    return out


QUICK_CELLS = (
    ("inference", "kill", "transfer"),
    ("trainer", "kill", "transfer"),
    ("inference", "kill", "ack.before"),
    ("trainer", "kill", "plan.agreed"),
    ("inference", "restart<ttl", "transfer"),
    ("trainer", "terminate", "transfer[0]"),
    ("inference", "stop>ttl", "transfer[0]"),
    ("trainer", "stall>ttl", "plan.agreed"),
    ("inference", "slow", "transfer"),
    ("coordinator", "kill", "commit"),
    ("inference", "kill+kill", "transfer>reconfiguring"),
    ("inference", "restart+kill", "rejoin"),
    ("etcd", "etcd_restart<ttl", "transfer"),
    ("etcd", "etcd_restart~ttl", "transfer"),
    ("etcd", "etcd_stall2x>ttl", "transfer"),
)
# Cells kept out of the quick matrix for a known runtime bug (they stay in the full one),
# with the reason. Empty: every cell the full matrix found failing was fixed in the runtime.
QUICK_EXCLUDED: dict[tuple[str, str, str], str] = {}


def _in_quick(victim: str, fault: str, phase: str) -> bool:
    return any(victim == v and fault == f and phase.startswith(p) for v, f, p in QUICK_CELLS)


def matrix_fault_names(etcd_nodes: int = 1) -> tuple[str, ...]:
    """Every fault name a matrix cell carries (``kill``, ``kill+kill``, ``stop>ttl``, ...)."""
    names: dict[str, None] = {}
    for _victim, fault, _phase, _plan in _templates(random.Random(0), 3, etcd_nodes):
        names.setdefault(fault, None)
    return tuple(names)


NO_FAULT_VERSIONS = 6  # a no-fault trial: long enough for the ring and the detector to be busy
NO_FAULT_SLOW_S = 0.2  # the slow-rank fault's delay per message (the full matrix's)


def no_fault_scenarios(trials: int, *, seed: int = 0, num_inference: int = 2, etcd_nodes: int = 1) -> list[Scenario]:
    """Trials in which nothing dies: every other one has no fault at all, the rest a slow
    rank (every transfer message delayed by the slow fault's 0.2 s) on a random trainer or
    inference rank. Run on a loaded machine they check the crash detector for false
    positives: the oracle fails a trial in which any member was fenced
    (``unsafe/no_live_member_fenced``)."""
    require_at_least("trials", trials, 1)
    rng = random.Random(seed)
    suffix = "" if etcd_nodes == 1 else f" (etcd x{etcd_nodes})"
    out = []
    for i in range(trials):
        if i % 2 == 0:
            victim, fault, phase, plan = "none", "none", "-", FaultPlan()
        else:
            victim = rng.choice(("trainer", "inference"))
            fault, phase = "slow", "transfer"
            plan = FaultPlan().slow(role=victim, rank=rng.randint(0, 1), version=rng.randint(2, NO_FAULT_VERSIONS),
                                    duration_s=NO_FAULT_SLOW_S)
        out.append(Scenario(f"{victim} x {fault} x {phase}{suffix}", victim, fault, phase, plan,
                            rng.randrange(1 << 30), NO_FAULT_VERSIONS, num_inference, etcd_nodes))
    return out


DELTA_CONFIG = {"delta_base_bytes": 64 << 20, "relay": "off"}  # relayed messages go in full


def with_deltas(scenarios: Sequence[Scenario], density: float = 0.02) -> list[Scenario]:
    """The same scenarios with deltas on (DESIGN.md, "Deltas"): every member keeps or takes
    deltas (``DELTA_CONFIG``), and each version changes about ``density`` of the elements
    of the one before, so refits go as deltas to the ranks that hold the latest commit and
    in full to the others (restarted ranks, joiners, catch-ups). Named ``... +deltas``."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    return [replace(s, name=f"{s.name} +deltas", delta_density=density,
                    member_config={**(s.member_config or {}), **DELTA_CONFIG}) for s in scenarios]


def build_matrix(name: str, *, trials: int | None = None, seed: int = 0, versions: int = 3,
                 num_inference: int = 2, etcd_nodes: int = 1,
                 faults: Sequence[str] | None = None) -> list[Scenario]:
    """The scenarios of matrix ``name`` (``quick``: one trial of a dozen cells; ``full``:
    every cell, repeated with fresh seeds until ``trials`` (default 200) are reached;
    ``none``: :func:`no_fault_scenarios`, ``trials`` of them, default 20).

    ``etcd_nodes=3`` runs every scenario against a 3-node etcd cluster and adds the cells
    that need one (an etcd member down for the rest of the trial); the quick matrix is
    then the cells whose victim is etcd, plus a rank kill.

    ``faults`` keeps only the cells of those fault names (exact: ``kill`` is not
    ``kill+kill``); the full matrix then repeats them until ``trials`` are reached.

    The same arguments give the same scenarios: every random choice (version, victim rank,
    chunk) comes from ``random.Random(seed)`` and the trial index."""
    if name not in ("quick", "full", "none"):
        raise ValueError(f"matrix must be 'quick', 'full' or 'none', got {name!r}")
    if trials is not None:
        require_at_least("trials", trials, 1)
    if etcd_nodes not in (1, 3):
        raise ValueError(f"etcd_nodes must be 1 or 3, got {etcd_nodes}")
    if name == "none":
        if faults is not None:
            raise ValueError(f"the 'none' matrix has no fault cells to keep, got faults={list(faults)}")
        return no_fault_scenarios(trials or 20, seed=seed, num_inference=num_inference, etcd_nodes=etcd_nodes)
    known = matrix_fault_names(etcd_nodes)
    if faults is not None:
        faults = tuple(faults)
        unknown = [f for f in faults if f not in known]
        if not faults or unknown:
            raise ValueError(f"faults must be a non-empty subset of {known}, got {list(faults)}")

    def kept(fault: str) -> bool:
        return faults is None or fault in faults

    rng = random.Random(seed)
    suffix = "" if etcd_nodes == 1 else f" (etcd x{etcd_nodes})"

    def scenario(victim: str, fault: str, phase: str, plan: FaultPlan) -> Scenario:
        return Scenario(f"{victim} x {fault} x {phase}{suffix}", victim, fault, phase, plan,
                        rng.randrange(1 << 30), versions, num_inference, etcd_nodes,
                        quick_excluded=QUICK_EXCLUDED.get((victim, fault, phase)))

    if name == "quick":
        def wanted(victim: str, fault: str, phase: str) -> bool:
            if etcd_nodes > 1:
                return kept(fault) and (victim == "etcd" or (victim, fault, phase.split("[")[0])
                                        == ("inference", "kill", "transfer"))
            return kept(fault) and _in_quick(victim, fault, phase) and (victim, fault, phase) not in QUICK_EXCLUDED

        scenarios = [scenario(*cell) for cell in _templates(rng, versions, etcd_nodes) if wanted(*cell[:3])]
        # One of each quick cell (the first template matching it).
        seen: set[tuple[str, str, str]] = set()
        unique = []
        for s in scenarios:
            key = (s.victim, s.fault, s.phase.split("[")[0])
            if key not in seen:
                seen.add(key)
                unique.append(s)
        return unique[:trials] if trials else unique
    target = trials or 200
    scenarios = []
    rnd = 0
    while len(scenarios) < target:
        for cell in _templates(random.Random(seed * 1_000_003 + rnd), versions, etcd_nodes):
            if not kept(cell[1]):
                continue
            scenarios.append(scenario(*cell))
            if len(scenarios) >= target:
                break
        rnd += 1
    return scenarios
