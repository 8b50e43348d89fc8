"""The agent's watchdog: an action that runs far past every deadline it has is a wedged
thread, not a slow one.

Every wait of the agent is bounded (transfers by the transport timeout, epochs by the epoch
deadline, idle waits by ``idle_wake_s``), so an action still running ``Timeouts.agent_stuck_s``
after it began is stuck where no deadline reaches: a GPU call that never returns (a stream
synchronize behind an NCCL kernel whose peers gave up), a hook that blocks. Measured on the
H100 (RL step under MPS, 2026-12-07): the coordinator sat in such a call while its lease and
liveness listener stayed alive, and its peers re-formed every 30 s for good, each time
failing on the path it never wrote. The watchdog names the action and where the thread is,
once, and the driver gives the member up (``Driver._stuck``): its peers drop it from the
epoch and go on, and every waiter of the member raises ``AgentStuck`` with the cause.

A process that was stopped (SIGSTOP, a frozen VM) is not a stuck agent: a poll that comes
much later than asked restarts the action's clock (:func:`overdue` is pure, clock passed in).
"""

from __future__ import annotations

import contextlib
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["AgentWatchdog", "Overdue", "overdue"]

_FRAMES = 12  # innermost frames of the stuck thread in the report
_STDLIB = sysconfig.get_paths()["stdlib"]


@dataclass(frozen=True, slots=True)
class Overdue:
    """``action`` has run ``seconds``; ``where``: the stuck thread's innermost frame outside
    the standard library, and ``stack`` its innermost frames, formatted."""

    action: str
    seconds: float
    where: str
    stack: str


def overdue(now: float, started: float, last_poll: float, *, bound_s: float, poll_s: float) -> tuple[float, bool]:
    """(the action's start, whether it is overdue) at ``now``: ``started`` moves to ``now``
    when this poll comes more than two poll intervals after ``last_poll`` (the process was
    stopped, and its waits were too); overdue once ``bound_s`` has passed since the start."""
    if now - last_poll > 2 * poll_s + 1.0:
        started = now
    return started, now - started >= bound_s


class AgentWatchdog:
    """Watches the action the agent thread is carrying out (``running``); calls
    ``on_stuck(Overdue)`` once per action that runs ``bound_s`` or longer."""

    def __init__(self, bound_s: float, on_stuck: Callable[[Overdue], None], *,
                 clock: Callable[[], float] = time.monotonic, name: str = "refit-watchdog") -> None:
        self.bound_s = bound_s
        self.poll_s = max(0.05, bound_s / 8)
        self._on_stuck = on_stuck
        self._clock = clock
        self._lock = threading.Lock()
        self._action: tuple[str, int, float] | None = None  # (name, thread id, start)
        self._reported = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> AgentWatchdog:
        if self.bound_s > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    @contextlib.contextmanager
    def running(self, action: str) -> Iterator[None]:
        """``with watchdog.running(name):`` around one action of the calling thread."""
        with self._lock:
            self._action, self._reported = (action, threading.get_ident(), self._clock()), False
        try:
            yield
        finally:
            with self._lock:
                self._action = None

    def _run(self) -> None:
        last = self._clock()
        while not self._stop.wait(self.poll_s):
            now = self._clock()
            with self._lock:
                if self._action is None or self._reported:
                    last = now
                    continue
                name, ident, started = self._action
                started, late = overdue(now, started, last, bound_s=self.bound_s, poll_s=self.poll_s)
                self._action, self._reported = (name, ident, started), late
            last = now
            if late:
                self._on_stuck(_report(name, ident, now - started))


def _report(action: str, ident: int, seconds: float) -> Overdue:
    frame = sys._current_frames().get(ident)  # the one way to see another thread's stack
    if frame is None:
        return Overdue(action, seconds, "(the thread is gone)", "")
    frames = traceback.extract_stack(frame)[-_FRAMES:]
    del frame  # a frame kept here would keep the agent's locals alive
    # where: the innermost frame outside the standard library (a lock's or an event's wait
    # says nothing; the call that waits on it does)
    inner = next((f for f in reversed(frames) if not f.filename.startswith(_STDLIB)), frames[-1])
    return Overdue(action, seconds, f"{inner.filename}:{inner.lineno} in {inner.name}",
                   "".join(traceback.format_list(frames)))
