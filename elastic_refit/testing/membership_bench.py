"""Membership recovery benchmark: SIGKILL a member, time detection, epoch, gloo rebuild.

A real etcd and ``members`` agent processes (``python -m elastic_refit.testing.agent --comm gloo``).
Each trial SIGKILLs one member at random and measures, from the kill:

- detect: the member's key disappears (its lease expired) as seen by a watch;
- epoch: the leader's next epoch without the member is visible;
- rebuild: each survivor's abort-and-rebuild of its gloo communicator (from its own
  ``comm.reconfigured`` event; the slowest survivor counts), and ``ready``: the time
  until every survivor has verified the new communicator with an all-reduce.

The victim is then restarted (a new incarnation) and the next trial waits until all
members share a verified communicator again.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from elastic_refit._validate import require_at_least
from elastic_refit.membership.client import EtcdClient
from elastic_refit.membership.keys import JobKeys
from elastic_refit.membership.view import MembershipView
from elastic_refit.membership.watch import RangeWatcher
from elastic_refit.testing.agent import AgentProcess
from elastic_refit.testing.etcd import EtcdServer
from elastic_refit.testing.stats import percentile


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Benchmark shape: ``members`` processes, ``trials`` kills, lease ``ttl_s``."""

    members: int = 4
    trials: int = 10
    ttl_s: int = 2
    seed: int = 0
    settle_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        require_at_least("--members", self.members, 2, "one survivor at least")
        require_at_least("--trials", self.trials, 1)
        require_at_least("--ttl", self.ttl_s, 2, "etcd grants no shorter lease")


@dataclass(frozen=True, slots=True)
class Trial:
    victim: str
    detect_s: float
    epoch_s: float
    rebuild_s: float
    ready_s: float
    epoch: int


class _EpochWatch:
    """What a watch of the job's control range saw, with the times it saw it: members'
    keys deleted (their leases expired) and each new epoch's view."""

    def __init__(self, client: EtcdClient, keys: JobKeys) -> None:
        self.keys = keys
        self.gone: dict[str, float] = {}  # member_id -> when its key was deleted
        self.epochs: list[tuple[float, MembershipView]] = []
        self.lock = threading.Lock()
        start, end = keys.control_range
        self.watcher = RangeWatcher(client, start, end, name="bench")
        self.watcher.add_listener(self._on_change)
        self.watcher.start()

    def _on_change(self, reset, events, snap) -> None:
        now = time.time()
        with self.lock:
            for ev in events:
                parsed = self.keys.parse_member_key(ev.key)
                if parsed and ev.kind == "delete":
                    self.gone[parsed[1]] = now
            kv = snap.items.get(self.keys.epoch)
            if kv is not None:
                v = MembershipView.decode(kv.value)
                if not self.epochs or self.epochs[-1][1].epoch != v.epoch:
                    self.epochs.append((now, v))

    def wait_without(self, member_id: str, since: float, timeout_s: float) -> tuple[float, float, MembershipView]:
        """When ``member_id``'s key went and the first epoch without it (both after
        ``since``) was seen: (gone at, epoch at, the epoch's view)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                t_gone = self.gone.get(member_id, 0.0)
                new = next(((t, v) for t, v in self.epochs if t >= since and member_id not in v), None)
            if t_gone >= since and new is not None:
                return t_gone, new[0], new[1]
            time.sleep(0.005)
        raise TimeoutError(f"no epoch without {member_id}")

    def stop(self) -> None:
        self.watcher.stop()


def _kill_one(cfg: BenchConfig, members: list[AgentProcess], victim: AgentProcess, watch: _EpochWatch,
              k: int) -> Trial:
    """SIGKILL ``victim`` and time the survivors' way to a verified communicator without it."""
    survivors = [m for m in members if m is not victim]
    t_kill = time.time()
    victim.kill()
    try:
        t_gone, t_epoch, view = watch.wait_without(victim.member_id, t_kill, cfg.settle_timeout_s)
    except TimeoutError as exc:
        raise TimeoutError(f"trial {k}: {exc}") from None
    recs = [m.wait_event(lambda e, ep=view.epoch: e.get("event") == "comm.reconfigured"
                         and e.get("epoch") == ep, cfg.settle_timeout_s) for m in survivors]
    oks = [m.wait_event(lambda e, ep=view.epoch: e.get("event") == "comm.verified"
                        and e.get("epoch") == ep, cfg.settle_timeout_s) for m in survivors]
    return Trial(victim=victim.member_id, detect_s=t_gone - t_kill, epoch_s=t_epoch - t_kill,
                 rebuild_s=max(r["seconds"] for r in recs), ready_s=max(o["_t"] for o in oks) - t_kill,
                 epoch=view.epoch)


def run_membership_bench(cfg: BenchConfig, progress: Callable[[str], None] = lambda _: None) -> dict:
    """Run the benchmark and return its summary (seconds; see the module docstring)."""
    rng = random.Random(cfg.seed)
    job = f"bench-{os.getpid()}"
    trials: list[Trial] = []
    with EtcdServer(name="bench") as etcd:
        client = EtcdClient(etcd.endpoints)
        watch = _EpochWatch(client, JobKeys(job))
        members = [AgentProcess(etcd.endpoints, job, f"m{i}", ttl=cfg.ttl_s, comm="gloo", start=False) for i in range(cfg.members)]
        try:
            progress(f"starting etcd and {cfg.members} member processes")
            for m in members:
                m.start()
            epoch = _wait_all_verified(members, cfg.members, 0, cfg.settle_timeout_s)
            for k in range(cfg.trials):
                victim = rng.choice(members)
                trial = _kill_one(cfg, members, victim, watch, k)
                trials.append(trial)
                progress(f"trial {k + 1}/{cfg.trials}: killed {victim.member_id}, detect "
                         f"{trial.detect_s:.3f}s, epoch {trial.epoch_s:.3f}s, rebuild "
                         f"{trial.rebuild_s * 1e3:.1f}ms")
                victim.start()
                epoch = _wait_all_verified(members, cfg.members, trial.epoch, cfg.settle_timeout_s)
        finally:
            for m in members:
                m.stop()
            watch.stop()
            leases_left = len(client.leases())
            client.close()
    return _summary(cfg, trials, leases_left, epoch)


def _summary(cfg: BenchConfig, trials: list[Trial], leases_left: int, last_epoch: int) -> dict:
    detect = [t.detect_s for t in trials]
    epoch_t = [t.epoch_s for t in trials]
    rebuild = [t.rebuild_s for t in trials]
    ready = [t.ready_s for t in trials]
    return {
        "members": cfg.members,
        "trials": len(trials),
        "ttl_s": cfg.ttl_s,
        "detect_p50_s": percentile(detect, 50),
        "detect_p99_s": percentile(detect, 99),
        "epoch_p50_s": percentile(epoch_t, 50),
        "epoch_p99_s": percentile(epoch_t, 99),
        "epoch_max_s": max(epoch_t),
        "rebuild_p50_s": percentile(rebuild, 50),
        "rebuild_p99_s": percentile(rebuild, 99),
        "ready_p50_s": percentile(ready, 50),
        "ready_p99_s": percentile(ready, 99),
        "goal_epoch_p99_s": cfg.ttl_s + 0.5,
        "goal_met": percentile(epoch_t, 99) <= cfg.ttl_s + 0.5,
        "leases_left": leases_left,
        "last_epoch": last_epoch,
        "per_trial": [asdict(t) for t in trials],
    }


def _wait_all_verified(members: list[AgentProcess], size: int, after_epoch: int, timeout_s: float) -> int:
    """Wait until every member verified a communicator of ``size`` ranks in one epoch."""
    deadline = time.monotonic() + timeout_s
    while True:
        latest = []
        for m in members:
            with m.cond:
                eps = [e["epoch"] for e in m.events if e.get("event") == "comm.verified"
                       and e.get("total") == float(size) and e["epoch"] > after_epoch]
            latest.append(max(eps) if eps else None)
        if all(x is not None for x in latest) and len(set(latest)) == 1:
            return latest[0]  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise TimeoutError(f"members did not agree on a {size}-rank communicator "
                               f"after epoch {after_epoch} (latest verified: {latest})")
        time.sleep(0.02)
