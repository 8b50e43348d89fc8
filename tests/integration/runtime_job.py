"""A local elastic job for runtime tests: a real etcd, member processes started and
killed by pid, results collected from each member."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

from elastic_refit.testing.faults import fault_hooks, kill_self
from elastic_refit.testing.job import MemberSpec, run_member
from elastic_refit.testing.processes import apply_environ, fork_server_context


def _child(member: MemberSpec, hook, results, environ: dict[str, str]) -> None:
    apply_environ(environ)
    try:
        results.put(run_member(member, hooks=fault_hooks(hook) if hook is not None else None))
    except BaseException as exc:  # reported, the test decides
        results.put({"member_id": member.member_id, "error_type": type(exc).__name__,
                     "error": f"{exc}\n{traceback.format_exc(limit=5)}"})


@dataclass(frozen=True)
class KillSelf:
    """Phase hook: SIGKILL this process at ``phase`` of ``version`` (at ``transfer.before``,
    after ``after_sends`` sends of the transfer)."""

    member_id: str
    version: int
    phase: str = "transfer.before"
    after_sends: int = 0

    def __call__(self, phase: str, context: dict[str, Any]) -> None:
        if context["member_id"] != self.member_id or phase != self.phase or context.get("version") != self.version:
            return
        if phase != "transfer.before" or self.after_sends == 0:
            kill_self()
        context["transport"].inject(kill_self, after=self.after_sends, op="send")


@dataclass
class RaiseOnce:
    """Fault hook: raise ``RuntimeError`` once at ``phase`` of ``version`` (a bug in one
    attempt of this member, e.g. in planning)."""

    member_id: str
    version: int
    phase: str = "attempt.start"
    fired: bool = False

    def __call__(self, phase: str, context: dict[str, Any]) -> None:
        if self.fired or context["member_id"] != self.member_id or phase != self.phase \
                or context.get("version") != self.version:
            return
        self.fired = True
        raise RuntimeError(f"injected bug in {self.member_id} at {phase} of version {self.version}")


class LocalJob:
    """Start members as processes (forked from the harness's fork server); collect what
    each one reports."""

    def __init__(self) -> None:
        self.ctx = fork_server_context()
        self.results = self.ctx.Queue()
        self.procs: dict[str, mp.Process] = {}
        self.reports: dict[str, dict[str, Any]] = {}

    def start(self, member: MemberSpec, hook=None) -> mp.Process:
        """Start ``member``; ``hook`` is a phase hook installed in its process."""
        p = self.ctx.Process(target=_child, args=(member, hook, self.results, dict(os.environ)), daemon=True)
        p.start()
        self.procs[member.member_id] = p
        return p

    def signal(self, member_id: str, sig: int) -> None:
        pid = self.procs[member_id].pid
        assert pid is not None
        os.kill(pid, sig)

    def collect(self, member_ids: list[str], timeout_s: float) -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while any(m not in self.reports for m in member_ids) and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                r = self.results.get(timeout=0.2)
                self.reports[r["member_id"]] = r
        missing = [m for m in member_ids if m not in self.reports]
        assert not missing, f"members {missing} did not report within {timeout_s} s (hung?)"
        return {m: self.reports[m] for m in member_ids}

    def stop(self) -> None:
        for p in self.procs.values():
            if p.is_alive() and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                    os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=5)
