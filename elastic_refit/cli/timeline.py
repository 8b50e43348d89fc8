"""A Chrome / Perfetto trace of a run, built from its JSON logs (docs/LOGS.md).

One process row per member (trainers first), one thread per incarnation of it (a restart
is a new row under the same member); a ``job`` row holds what no member owns alone: the
epochs, each version from its first publish to its commit (async slices, so versions one
step apart overlap), every fault (a global marker) and the recovery after it (fault ->
next commit). An event with a ``seconds`` field becomes a slice ending where it was
logged (transfers, plans, epoch entries, communicator builds, serving pauses, RL step
phases); the events of one attempt (``epoch``, ``seq``) are wrapped in an attempt slice;
everything else is an instant. An inference member's served version is a counter.

Pure: :func:`build_trace` takes parsed events and fault records, :func:`read_run` reads
a folder (or files) of ``*.log`` JSON lines and chaos ``faults.jsonl`` records.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["build_trace", "read_run"]

_PREFIXES = ("refit.", "membership.", "comm.", "fault.", "transport.", "rl.", "agent.")
_JOB_PID = 1
_JOB_THREADS = {"epochs": 1, "versions": 2, "faults": 3, "recovery": 4}
_FAULT_EVENTS = {"fault.detected", "refit.attempt.failed", "membership.member.lost", "refit.version.failed",
                 "refit.communicator.broken", "membership.suspect.confirmed", "transport.executor.failed",
                 "refit.serving.skipped"}
_DROP = {"event", "level", "timestamp", "_t", "_incarnation", "job", "role", "member_id", "incarnation"}


def _unix(value: Any) -> float | None:
    if isinstance(value, int | float):
        return float(value)
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def read_run(paths: Sequence[str | Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(log events, fault records) of every ``*.log`` / ``*.jsonl`` under ``paths``
    (folders are searched recursively). Lines that are not JSON objects (C++ noise, a line
    cut by SIGKILL) are skipped; each event gets ``_t``, its unix time."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(q for q in p.rglob("*") if q.is_file() and q.suffix in (".log", ".jsonl"))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(2, "No such file or directory", str(p))
    events, faults = [], []
    for path in files:
        mine = _read_file(path, faults)
        # One file is one process: events logged without the member's context (the
        # executor's, the etcd client's) belong to the member the file's other events name.
        # (An event may carry another member's incarnation, e.g. a confirmed suspect's:
        # the row is the file's most common one.)
        named = {e["member_id"] for e in mine if e.get("member_id")}
        who = next(({k: e[k] for k in _WHO if k in e} for e in mine if e.get("member_id")), {})
        if len(named) == 1:
            incarnation = Counter(e.get("incarnation") for e in mine if e.get("incarnation")).most_common(1)
            who["_incarnation"] = incarnation[0][0] if incarnation else None
            mine = [{**who, **e, "_incarnation": who["_incarnation"]} for e in mine]
        events += mine
    return events, faults


_WHO = ("member_id", "role", "incarnation", "job")


def _read_file(path: Path, faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The log events of one file (fault records go to ``faults``)."""
    events = []
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        if "event" in record:
            record["_t"] = _unix(record.get("timestamp"))
            if record["_t"] is not None:
                events.append(record)
        elif {"index", "kind", "t"} <= record.keys():  # a chaos fault record
            faults.append(record)
    return events


class _Rows:
    """pid per member, tid per incarnation, and the metadata events naming them."""

    def __init__(self) -> None:
        self.meta: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": _JOB_PID, "tid": 0, "args": {"name": "job"}},
            {"ph": "M", "name": "process_sort_index", "pid": _JOB_PID, "tid": 0, "args": {"sort_index": 0}}]
        self.meta += [{"ph": "M", "name": "thread_name", "pid": _JOB_PID, "tid": tid, "args": {"name": name}}
                      for name, tid in _JOB_THREADS.items()]
        self._pids: dict[str, int] = {}
        self._tids: dict[tuple[str, str], int] = {}

    def declare(self, events: Iterable[dict[str, Any]]) -> None:
        members = {(e.get("role") or "", e["member_id"]) for e in events if e.get("member_id")}
        order = sorted(members, key=lambda m: (m[0] != "trainer", m[0], m[1]))
        for index, (role, member) in enumerate(order):
            if member in self._pids:
                continue
            pid = self._pids[member] = _JOB_PID + 1 + index
            self.meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                              "args": {"name": f"{role} {member}".strip()}})
            self.meta.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                              "args": {"sort_index": index + 1}})

    def of(self, event: dict[str, Any]) -> tuple[int, int]:
        member = event.get("member_id")
        if not member or member not in self._pids:
            return _JOB_PID, _JOB_THREADS["faults"] if event.get("event") in _FAULT_EVENTS else 0
        pid = self._pids[member]
        incarnation = str(event.get("_incarnation") or event.get("incarnation") or "-")
        key = (member, incarnation)
        if key not in self._tids:
            tid = self._tids[key] = 1 + sum(1 for m, _ in self._tids if m == member)
            self.meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                              "args": {"name": f"incarnation {incarnation}"}})
        return pid, self._tids[key]

    def member_pid(self, member: str | None) -> int | None:
        return self._pids.get(member) if member else None


def _name(event: dict[str, Any]) -> str:
    name = event["event"]
    if "version" in event and event["version"] is not None:
        name += f" v{event['version']}"
    elif "epoch" in event and event["epoch"] is not None and name.startswith(("comm.", "membership.epoch")):
        name += f" e{event['epoch']}"
    return name


def _args(event: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k not in _DROP}


def build_trace(events: Sequence[dict[str, Any]], faults: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The Chrome trace (``{"traceEvents": [...]}``, times in microseconds from the first
    event) of a run's ``events`` (parsed JSON log lines with ``_t``) and chaos ``faults``."""
    events = sorted((e for e in events if str(e.get("event", "")).startswith(_PREFIXES) and e.get("_t") is not None),
                    key=lambda e: e["_t"])
    starts = [e["_t"] - _seconds(e) for e in events] + [float(f["t"]) for f in faults]
    t0 = min(starts, default=0.0)

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 1)

    rows = _Rows()
    rows.declare(events)
    out: list[dict[str, Any]] = []
    for e in events:
        pid, tid = rows.of(e)
        cat = "fault" if e["event"] in _FAULT_EVENTS else e["event"].split(".", 1)[0]
        seconds = _seconds(e)
        if seconds > 0 or "seconds" in e:
            out.append({"ph": "X", "name": _name(e), "cat": cat, "pid": pid, "tid": tid,
                        "ts": us(e["_t"] - seconds), "dur": round(seconds * 1e6, 1), "args": _args(e)})
        else:
            out.append({"ph": "i", "s": "t", "name": _name(e), "cat": cat, "pid": pid, "tid": tid,
                        "ts": us(e["_t"]), "args": _args(e)})
        if e["event"] == "refit.version.serving" and e.get("version") is not None:
            out.append({"ph": "C", "name": "serving version", "pid": pid, "tid": tid, "ts": us(e["_t"]),
                        "args": {"version": e["version"]}})
    out += _attempts(events, rows, us)
    out += _epochs(events, us)
    out += _versions(events, us)
    out += _faults(faults, events, rows, us)
    return {"traceEvents": rows.meta + out, "displayTimeUnit": "ms",
            "otherData": {"source": "elastic-refit timeline", "t0_unix_s": t0, "num_log_events": len(events),
                          "num_faults": len(faults)}}


def _seconds(event: dict[str, Any]) -> float:
    value = event.get("seconds")
    return float(value) if isinstance(value, int | float) and value > 0 else 0.0


def _attempts(events: Sequence[dict[str, Any]], rows: _Rows, us) -> list[dict[str, Any]]:
    """One slice per member incarnation and attempt, around that attempt's events."""
    groups: dict[tuple[int, int, str, Any, Any], list[dict[str, Any]]] = {}
    for e in events:
        if e.get("member_id") and e.get("seq") is not None and e.get("epoch") is not None:
            pid, tid = rows.of(e)
            groups.setdefault((pid, tid, str(e.get("job") or ""), e["epoch"], e["seq"]), []).append(e)
    out = []
    for (pid, tid, job, epoch, seq), group in groups.items():
        begin = min(e["_t"] - _seconds(e) for e in group)
        end = max(e["_t"] for e in group)
        failed = any(e["event"] == "refit.attempt.failed" for e in group)
        version = next((e.get("version") for e in group if e.get("version") is not None), None)
        out.append({"ph": "X", "name": f"attempt e{epoch}#{seq} v{version}" + (" (failed)" if failed else ""),
                    "cat": "attempt", "pid": pid, "tid": tid, "ts": us(begin), "dur": round((end - begin) * 1e6, 1),
                    "args": {"job": job, "epoch": epoch, "seq": seq, "version": version, "failed": failed,
                             "kind": group[0].get("kind")}})
    return out


def _epochs(events: Sequence[dict[str, Any]], us) -> list[dict[str, Any]]:
    """Each epoch of each job from the first time any member saw it to the next one."""
    first: dict[tuple[str, int], dict[str, Any]] = {}
    for e in events:
        if e["event"] == "membership.epoch.changed" and isinstance(e.get("epoch"), int):
            first.setdefault((str(e.get("job") or ""), e["epoch"]), e)
    jobs = sorted({job for job, _ in first})
    end_of_run = events[-1]["_t"] if events else 0.0
    out = []
    for job in jobs:
        ordered = sorted((epoch, e) for (j, epoch), e in first.items() if j == job)
        for i, (epoch, e) in enumerate(ordered):
            end = ordered[i + 1][1]["_t"] if i + 1 < len(ordered) else _job_end(events, job, end_of_run)
            out.append({"ph": "X", "name": f"{job} epoch {epoch}" if len(jobs) > 1 else f"epoch {epoch}",
                        "cat": "epoch", "pid": _JOB_PID, "tid": _JOB_THREADS["epochs"], "ts": us(e["_t"]),
                        "dur": round(max(0.0, end - e["_t"]) * 1e6, 1),
                        "args": {"job": job, **{k: e.get(k) for k in ("num_members", "added", "removed")}}})
    return out


def _job_end(events: Sequence[dict[str, Any]], job: str, default: float) -> float:
    mine = [e["_t"] for e in events if str(e.get("job") or "") == job]
    return max(mine) if mine else default


def _versions(events: Sequence[dict[str, Any]], us) -> list[dict[str, Any]]:
    """Each version of each job from its first publish to its commit (or failure): async slices."""
    published: dict[tuple[str, int], float] = {}
    over: dict[tuple[str, int], tuple[float, str]] = {}
    for e in events:
        v, job = e.get("version"), str(e.get("job") or "")
        if not isinstance(v, int):
            continue
        if e["event"] == "refit.version.published":
            published.setdefault((job, v), e["_t"])
        elif e["event"] in ("refit.version.committed", "refit.version.failed") and (job, v) not in over:
            over[(job, v)] = (e["_t"], "committed" if e["event"].endswith("committed") else "failed")
    several = len({job for job, _ in published}) > 1
    out = []
    for (job, v), begin in sorted(published.items()):
        end, outcome = over.get((job, v), (None, "pending"))
        if end is None:
            continue
        name = f"{job} v{v} {outcome}" if several else f"v{v} {outcome}"
        common = {"name": name, "cat": "version", "id": f"{job}:{v}" if several else v, "pid": _JOB_PID,
                  "tid": _JOB_THREADS["versions"]}
        out.append({**common, "ph": "b", "ts": us(begin), "args": {"job": job, "version": v, "outcome": outcome,
                                                                   "seconds": end - begin}})
        out.append({**common, "ph": "e", "ts": us(end)})
    return out


def _faults(faults: Sequence[dict[str, Any]], events: Sequence[dict[str, Any]], rows: _Rows,
            us) -> list[dict[str, Any]]:
    """Each injected fault: a global marker, a marker on its member, and the recovery slice
    (fault -> the next commit after it)."""
    commits = sorted(e["_t"] for e in events if e["event"] == "refit.version.committed")
    out = []
    for f in sorted(faults, key=lambda f: f["t"]):
        t = float(f["t"])
        label = f"fault: {f.get('kind')} {f.get('member_id')} ({f.get('phase')} v{f.get('version')})"
        args = {k: f.get(k) for k in ("index", "kind", "member_id", "role", "phase", "version", "epoch", "pid")}
        out.append({"ph": "i", "s": "g", "name": label, "cat": "fault", "pid": _JOB_PID,
                    "tid": _JOB_THREADS["faults"], "ts": us(t), "args": args})
        pid = rows.member_pid(f.get("member_id"))
        if pid is not None:
            out.append({"ph": "i", "s": "p", "name": label, "cat": "fault", "pid": pid, "tid": 0, "ts": us(t),
                        "args": args})
        after = [c for c in commits if c >= t]
        if after:
            out.append({"ph": "X", "name": f"recovery after {f.get('kind')} {f.get('member_id')}", "cat": "recovery",
                        "pid": _JOB_PID, "tid": _JOB_THREADS["recovery"], "ts": us(t),
                        "dur": round((after[0] - t) * 1e6, 1), "args": {**args, "seconds": after[0] - t}})
    return out
