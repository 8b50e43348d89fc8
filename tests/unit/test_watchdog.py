"""The agent's watchdog (``runtime.watchdog``): the pure overdue rule as a table, and the
watchdog thread against a thread that really blocks."""

from __future__ import annotations

import threading
import time

import pytest

from elastic_refit.runtime.watchdog import AgentWatchdog, overdue


@pytest.mark.parametrize("now, started, last_poll, want", [
    (10.0, 0.0, 9.5, (0.0, False)),    # running 10 s of a 12 s bound
    (12.0, 0.0, 11.5, (0.0, True)),    # 12 s: overdue
    (30.0, 0.0, 11.5, (30.0, False)),  # polled 18.5 s late: the process was stopped, the clock restarts
    (12.0, 0.0, 9.0, (0.0, True)),     # 3 s late is within 2 polls + 1 s: not a stop
])
def test_overdue(now, started, last_poll, want):
    assert overdue(now, started, last_poll, bound_s=12.0, poll_s=1.5) == want


def _blocked_here(release: threading.Event) -> None:
    release.wait(30)


def test_a_blocked_action_is_reported_once_with_where_it_is():
    reports, release = [], threading.Event()
    dog = AgentWatchdog(0.4, reports.append).start()
    try:
        def agent() -> None:
            with dog.running("RunAttempt"):
                _blocked_here(release)
            with dog.running("Idle"):  # short: never reported
                time.sleep(0.05)

        thread = threading.Thread(target=agent)
        thread.start()
        deadline = time.monotonic() + 10
        while not reports and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # later polls of the same action add nothing
        release.set()
        thread.join(10)
        time.sleep(0.3)
    finally:
        dog.stop()
    assert len(reports) == 1, reports
    late = reports[0]
    assert late.action == "RunAttempt" and late.seconds >= 0.4
    assert "_blocked_here" in late.where and "_blocked_here" in late.stack


def test_bound_zero_is_off():
    dog = AgentWatchdog(0.0, lambda _late: pytest.fail("reported with the watchdog off")).start()
    with dog.running("RunAttempt"):
        time.sleep(0.2)
    dog.stop()
    assert not dog._thread.is_alive()
