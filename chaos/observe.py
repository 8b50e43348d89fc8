"""What a chaos trial watches while it runs: every commit as it lands (``CommitRecorder``)
and, for the demo, the trial's story told as it happens (``Narrator``)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic_refit.testing.logs import read_logs

__all__ = ["CommitRecorder", "Narrator"]


class CommitRecorder:
    """Every commit of a trial as it lands, from a watch on the job's versions: after each
    commit the coordinator prunes older versions (``VersionStore.prune``), so the final etcd
    state no longer lists every committed version. The watch resumes across etcd restarts
    from the last revision it saw (trials are far shorter than etcd's compaction period)."""

    def __init__(self, endpoints: tuple[str, ...], job: str) -> None:
        from elastic_refit.membership import EtcdClient, JobKeys
        from elastic_refit.membership.watch import RangeWatcher

        self.keys = JobKeys(job)
        self.client = EtcdClient(list(endpoints))
        self._committed: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()
        prefix = self.keys.versions_prefix
        self.watcher = RangeWatcher(self.client, prefix, prefix[:-1] + "0", name="chaos-commits")  # '0' follows '/'
        self.watcher.add_listener(self._on_change)
        self.watcher.start()

    def _on_change(self, reset: bool, events: list, snapshot: Any) -> None:
        kvs = list(snapshot.items.values()) if reset else [e.kv for e in events if e.kind == "put"]
        for kv in kvs:
            parsed = self.keys.parse_version_key(kv.key)
            if parsed is not None and parsed[1] == "committed":
                data = json.loads(kv.value)
                with self._lock:
                    self._committed[parsed[0]] = {"version": int(data["version"]), "epoch": int(data["epoch"]),
                                                  "digest": str(data["digest"])}

    def committed(self) -> dict[int, dict[str, Any]]:
        with self._lock:
            return dict(self._committed)

    def close(self) -> None:
        self.watcher.stop()
        self.client.close()


class Narrator:
    """Tells a trial's story as it happens: faults, restarts, commits (read through
    ``VersionStore``) and restarted ranks serving again (read from their logs)."""

    def __init__(self, say: Callable[[str], None], endpoints: tuple[str, ...], job: str, trial_dir: Path,
                 t0: float | None = None) -> None:
        from elastic_refit.membership import EtcdClient
        from elastic_refit.membership.versions import VersionStore

        self.say = say
        self.t0 = time.time() if t0 is None else t0  # its stamps: seconds since then (wall clock)
        self.client = EtcdClient(list(endpoints))
        self.versions = VersionStore(self.client, job)
        self.trial_dir = trial_dir
        self.committed: set[int] = set()
        self.waiting: dict[str, str] = {}  # restarted incarnation -> member id, until it serves
        self.next_tick = 0.0

    def _stamp(self) -> str:
        return f"[{time.time() - self.t0:5.1f}s]"

    def fault(self, fault: Any, record: dict[str, Any]) -> None:
        what = {"kill": "SIGKILLed", "restart": "SIGKILLed", "terminate": "sent SIGTERM", "stop": "SIGSTOPped",
                "stall": "stalled", "slow": "slowed down", "etcd_restart": "saw etcd go down",
                "etcd_stall": "saw etcd stall", "etcd_wipe": "saw etcd come back empty"}[fault.kind]
        self.say(f"{self._stamp()} FAULT: {record['member_id']} ({record.get('role')}) {what} during the refit "
                 f"of version {record.get('version')} ({record.get('phase')})")

    def restarted(self, member_id: str, incarnation: str) -> None:
        self.waiting[incarnation] = member_id
        self.say(f"{self._stamp()} {member_id} restarted as incarnation {incarnation}")

    def tick(self) -> None:
        if time.monotonic() < self.next_tick:
            return
        self.next_tick = time.monotonic() + 0.2
        with contextlib.suppress(Exception):  # etcd may be down on purpose
            state = self.versions.snapshot()
            for v in sorted(set(state.committed) - self.committed):
                self.committed.add(v)
                self.say(f"{self._stamp()} version {v} committed in epoch {state.committed[v].epoch} "
                         f"({len(state.acks.get(v, {}))} inference ranks acked)")
        for incarnation, member_id in list(self.waiting.items()):
            serving = [e for e in read_logs(self.trial_dir, incarnation).get(incarnation, [])
                       if e.get("event") == "refit.version.serving"]
            if serving:
                del self.waiting[incarnation]
                self.say(f"{self._stamp()} {member_id} caught up from its peers: serving version "
                         f"{serving[0].get('version')}")

    def close(self) -> None:
        self.next_tick = 0.0
        self.tick()
        self.client.close()
