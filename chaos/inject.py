"""Injection: the phase hook a member process runs, and the parent's process killer.

:class:`FaultHook` is picklable and built per member incarnation with only the faults
that may fire there; the worker gives it to its context with ``fault_hooks`` (a member without
faults installs nothing, and the runtime's hooks then cost nothing). When a fault fires, the hook
claims it exactly once across processes (an ``O_EXCL`` marker file), appends a record
(fault index, member, phase, pid, time) to the trial's ``faults.jsonl`` and acts: it
signals its own process by pid (kill, terminate, stop), blocks (stall), programs the
epoch's ``FaultyTransport`` (slow messages, a fault before message k), or waits for the
parent to take etcd down.

:class:`Killer` signals processes the runner started, by pid only, and refuses any other
pid: it never looks processes up by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_refit.chaos.faults import ETCD_FAULTS, Fault, runtime_phase

from elastic_refit.testing.faults import FaultyTransport

__all__ = ["FaultHook", "Killer", "read_fault_records"]

_VERSIONLESS = ("comm.reconfiguring", "comm.ready")


@dataclass(frozen=True, slots=True)
class FaultHook:
    """The phase hook of one member incarnation: ``faults`` are (plan index, fault) pairs."""

    member_id: str
    life: int
    faults: tuple[tuple[int, Fault], ...]
    trial_dir: str

    def __post_init__(self) -> None:
        if not self.faults:
            raise ValueError(f"{self.member_id}: a FaultHook needs at least one fault (install no hook instead)")

    # ---- the hook --------------------------------------------------------------------
    def __call__(self, phase: str, context: dict[str, Any]) -> None:
        state = _STATE.setdefault(id(self), {"seen_version": 0, "counts": {}, "armed": {}})
        version = context.get("version")
        if isinstance(version, int):
            state["seen_version"] = max(state["seen_version"], version)
        # A transfer fault that found fewer messages than its chunk fires at the next phase.
        for index, (fault, where) in list(state["armed"].items()):
            if phase != "transfer.before" and not self._fired(index):
                del state["armed"][index]
                self._fire(index, fault, context, f"{where}.end")
        for index, fault in self.faults:
            if not self._matches(index, fault, phase, context, state):
                continue
            if fault.at == "transfer":
                self._arm_transfer(index, fault, context, state)
            else:
                self._fire(index, fault, context, fault.at)

    def _matches(self, index: int, fault: Fault, phase: str, context: dict[str, Any], state: dict) -> bool:
        if phase != runtime_phase(fault.at) or self._fired(index):
            return False
        if fault.after is not None and not self._fired(fault.after):
            return False
        if fault.at == "rejoin" and not context.get("first"):
            return False
        if fault.version is not None:
            version = context.get("version")
            if phase in _VERSIONLESS:
                if state["seen_version"] < fault.version and fault.after is None:
                    return False
            elif version is None or version < fault.version:
                return False
        elif phase in _VERSIONLESS and fault.after is None:
            counts = state["counts"]
            counts[(index, phase)] = counts.get((index, phase), 0) + 1
            if counts[(index, phase)] < fault.nth:
                return False
        return True

    # ---- firing ------------------------------------------------------------------------
    def _marker(self, index: int) -> Path:
        return Path(self.trial_dir) / f"fired-{index}"

    def _fired(self, index: int) -> bool:
        return self._marker(index).exists()

    def _claim(self, index: int) -> bool:
        try:
            fd = os.open(self._marker(index), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        os.close(fd)
        return True

    def _record(self, index: int, fault: Fault, context: dict[str, Any], where: str, **extra: Any) -> None:
        record = {"index": index, "kind": fault.kind, "member_id": self.member_id, "life": self.life,
                  "role": context.get("role"), "phase": where, "version": context.get("version"),
                  "epoch": context.get("epoch"), "pid": os.getpid(), "t": time.time(), **extra}
        line = (json.dumps(record) + "\n").encode()
        fd = os.open(Path(self.trial_dir) / "faults.jsonl", os.O_CREAT | os.O_APPEND | os.O_WRONLY, 0o644)
        try:
            os.write(fd, line)  # one write of one line: appends from several processes stay whole
            os.fsync(fd)
        finally:
            os.close(fd)

    def _fire(self, index: int, fault: Fault, context: dict[str, Any], where: str, **extra: Any) -> None:
        if not self._claim(index):
            return
        self._record(index, fault, context, where, **extra)
        pid = os.getpid()
        if fault.kind in ("kill", "restart"):
            os.kill(pid, signal.SIGKILL)
        elif fault.kind == "terminate":
            os.kill(pid, signal.SIGTERM)  # the main thread closes the refit: a clean leave
        elif fault.kind == "stop":
            # The parent sends SIGCONT after duration_s (it read the record above).
            os.kill(pid, signal.SIGSTOP)
        elif fault.kind == "stall":
            time.sleep(fault.duration_s)
        elif fault.kind in ETCD_FAULTS:
            # Stay in the phase until the parent has taken etcd down (or give up after 3 s).
            ack = Path(self.trial_dir) / f"ack-{index}"
            deadline = time.monotonic() + 3.0
            while not ack.exists() and time.monotonic() < deadline:
                time.sleep(0.01)

    def _arm_transfer(self, index: int, fault: Fault, context: dict[str, Any], state: dict) -> None:
        transport = context.get("transport")
        n = _num_messages(context.get("executor"))
        if not isinstance(transport, FaultyTransport):
            self._fire(index, fault, context, "transfer[0]", messages=n)
            return
        if fault.kind == "slow":
            if self._claim(index):
                self._record(index, fault, context, "transfer", messages=n, delay_s=fault.duration_s)
                transport.delay(fault.duration_s)
            return
        if fault.chunk == 0:
            self._fire(index, fault, context, "transfer[0]", messages=n)
            return
        state["armed"][index] = (fault, "transfer")
        # The action keeps none of the context's objects (no executor, no transport), so it
        # adds no reference cycle that would keep a closed transport alive.
        record_context = {k: v for k, v in context.items() if k not in ("transport", "executor")}

        def fire() -> None:
            if state["armed"].pop(index, None) is not None:
                self._fire(index, fault, record_context, f"transfer[{fault.chunk}]", messages=n)

        transport.inject(fire, after=fault.chunk)


# Per-process mutable state of hooks (the dataclass is frozen and slotted); keyed by id.
_STATE: dict[int, dict[str, Any]] = {}


def reset_state() -> None:
    """Forget every hook's per-process state (a reused worker process starts clean)."""
    _STATE.clear()


def _num_messages(executor: Any) -> int | None:
    """This rank's transfer messages (buckets sent + received), when the executor shows them."""
    with contextlib.suppress(Exception):
        return sum(len(msg.buckets) for step in executor.schedule.steps for msg in (step.send, step.recv)
                   if msg is not None)
    return None


def read_fault_records(trial_dir: str | Path) -> list[dict[str, Any]]:
    """The fault records hooks appended to ``trial_dir/faults.jsonl`` (oldest first)."""
    path = Path(trial_dir) / "faults.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


class Killer:
    """Signals processes the runner started, by pid; refuses pids it was not given."""

    def __init__(self) -> None:
        self._pids: set[int] = set()
        self._lock = threading.Lock()
        self.sent: list[tuple[float, int, int]] = []  # (time, pid, signal)

    def adopt(self, pid: int) -> None:
        """Allow signalling ``pid`` (a process this runner started)."""
        with self._lock:
            self._pids.add(pid)

    def forget(self, pid: int) -> None:
        with self._lock:
            self._pids.discard(pid)

    def signal(self, pid: int, sig: int) -> bool:
        """Send ``sig`` to ``pid``; False if it is already gone. ValueError for a pid we did not start."""
        with self._lock:
            if pid not in self._pids:
                raise ValueError(f"pid {pid} was not started by this runner; refusing to signal it")
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        self.sent.append((time.time(), pid, int(sig)))
        return True

    def cont_later(self, pid: int, delay_s: float) -> threading.Timer:
        """SIGCONT ``pid`` after ``delay_s`` (the end of a stop fault)."""
        timer = threading.Timer(delay_s, lambda: self.signal(pid, signal.SIGCONT))
        timer.daemon = True
        timer.start()
        return timer
