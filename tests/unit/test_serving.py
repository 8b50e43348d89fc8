"""The serving slot: a staged switch never waits for a reader, and a reader is never torn.

Real parts (ServingSlot, Outcomes, EventLog) and real threads; the "engine" is a reader
that holds ``weights()`` (enter .. leave) through a long generation and checks, step after
step, that every tensor it reads holds the version it entered with."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from elastic_refit.log import get_logger
from elastic_refit.runtime.events import EventLog
from elastic_refit.runtime.outcomes import Outcomes
from elastic_refit.runtime.serving import ServingSlot

NUM_TENSORS, NUMEL = 4, 1 << 20


def _slot(staged: bool) -> tuple[ServingSlot, Outcomes, list[tuple[str, dict]]]:
    events: list[tuple[str, dict]] = []
    log = EventLog(get_logger("test"), lambda name, fields: events.append((name, fields)))
    outcomes = Outcomes("inf-0")
    params = {f"w{i}": torch.zeros(NUMEL) for i in range(NUM_TENSORS)}
    return ServingSlot(params, staged=staged, outcomes=outcomes, log=log), outcomes, events


def _refit(slot: ServingSlot, version: int) -> float:
    """What a refit does to a destination: write, ack (digest), then serve at commit.
    Returns how long ``serve`` took (the agent thread's cost)."""
    slot.begin_apply()
    for tensor in slot.incoming.values():
        tensor.fill_(float(version))
    slot.digest()
    t0 = time.perf_counter()
    slot.serve(version)
    return time.perf_counter() - t0


def _versions_read(slot: ServingSlot) -> set[float]:
    """Each tensor checked whole: one value per tensor, the same across all of them."""
    seen = set()
    for tensor in slot.parameters.values():
        lo, hi = tensor.min().item(), tensor.max().item()
        assert lo == hi, f"a torn tensor: {lo} .. {hi}"
        seen.add(lo)
    return seen


def _paused(events: list[tuple[str, dict]]) -> dict[int, dict]:
    return {f["version"]: f for name, f in events if name == "refit.serving.paused"}


def test_a_long_reader_is_never_torn_and_never_holds_the_staged_switch_back():
    slot, outcomes, events = _slot(staged=True)
    _refit(slot, 1)
    assert slot.serving == 1 and _paused(events)[1]["deferred_s"] < 0.5  # no reader: switched at once

    entered, leave, torn = threading.Event(), threading.Event(), []
    steps = []

    def generation() -> None:
        version = outcomes.wait_for(slot.enter, 5, "a version")
        entered.set()
        try:
            while not leave.is_set():  # decode steps, each reading every weight
                seen = _versions_read(slot)
                if seen != {float(version)}:
                    torn.append((version, seen))
                steps.append(version)
        finally:
            slot.leave()

    reader = threading.Thread(target=generation)
    reader.start()
    assert entered.wait(5)
    serve_s = _refit(slot, 2)  # committed while the generation is going on
    assert serve_s < 0.05, f"serve waited {serve_s:.3f} s for a reader"
    assert slot.serving == 1 and slot.pending == 2
    before = len(steps)
    time.sleep(0.3)
    assert len(steps) > before, "the generation stopped while version 2 was pending"
    leave.set()
    reader.join(5)
    assert not torn, torn
    assert set(steps) == {1}
    # The last reader out switched version 2 in; a new reader enters it, held back no
    # longer than the switch itself.
    switch = _paused(events)[2]
    t0 = time.perf_counter()
    version = outcomes.wait_for(lambda: slot.enter(2), 5, "version 2")
    waited = time.perf_counter() - t0
    slot.leave()
    assert version == 2 and _versions_read(slot) == {2.0}
    assert switch["deferred_s"] >= 0.3 and switch["mode"] == "staged"
    assert waited <= switch["seconds"] + 0.05, (waited, switch)


def test_readers_that_enter_during_the_switch_wait_for_the_copy_alone():
    slot, outcomes, events = _slot(staged=True)
    _refit(slot, 1)
    slot.begin_apply()
    for tensor in slot.incoming.values():
        tensor.fill_(2.0)
    slot.digest()
    waits, stop = [], threading.Event()

    def engine() -> None:  # back-to-back short reads: a switch lands between two of them
        while not stop.is_set():
            t0 = time.perf_counter()
            version = outcomes.wait_for(slot.enter, 5, "a version")
            waits.append(time.perf_counter() - t0)
            try:
                assert len(_versions_read(slot)) == 1
            finally:
                slot.leave()
            if version == 2:
                stop.set()

    thread = threading.Thread(target=engine)
    thread.start()
    time.sleep(0.05)
    slot.serve(2)
    thread.join(5)
    assert stop.is_set() and slot.serving == 2
    assert max(waits) <= _paused(events)[2]["seconds"] + 0.05, (max(waits), _paused(events)[2])


def test_a_refit_that_starts_while_a_switch_is_pending_skips_that_version():
    slot, _, events = _slot(staged=True)
    _refit(slot, 1)
    assert slot.enter() == 1  # a reader stays inside throughout
    _refit(slot, 2)
    assert slot.pending == 2
    slot.begin_apply()  # version 3 starts landing in the spares: 2 can no longer be switched in
    assert slot.pending is None
    assert not slot.serve(2), "a commit seen again must not serve half-written spares"
    assert _versions_read(slot) == {1.0}
    for tensor in slot.incoming.values():
        tensor.fill_(3.0)
    slot.digest()
    slot.serve(3)
    slot.leave()
    assert slot.serving == 3 and _versions_read(slot) == {3.0}
    assert [f["version"] for name, f in events if name == "refit.serving.skipped"] == [2]


def test_in_place_reports_the_pause_it_causes():
    slot, _, events = _slot(staged=False)
    _refit(slot, 1)
    slot.begin_apply()
    assert slot.enter() is None  # held back from the first write ...
    time.sleep(0.2)
    for tensor in slot.incoming.values():
        tensor.fill_(2.0)
    slot.digest()
    slot.serve(2)  # ... to the commit
    assert slot.enter() == 2
    slot.leave()
    paused = _paused(events)[2]
    assert paused["mode"] == "in_place" and paused["seconds"] >= 0.2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_switch_is_a_copy_at_memory_speed_on_a_gpu():
    params = {f"w{i}": torch.zeros(64 << 20, dtype=torch.bfloat16, device="cuda") for i in range(8)}  # 1 GiB
    events: list[tuple[str, dict]] = []
    slot = ServingSlot(params, staged=True, outcomes=Outcomes("inf-0"),
                       log=EventLog(get_logger("test"), lambda n, f: events.append((n, f))))
    for version in (1, 2, 3):
        _refit(slot, version)
    assert max(f["seconds"] for n, f in events if n == "refit.serving.paused") < 0.01


@pytest.mark.parametrize("keep", [True, False], ids=["keep", "block"])
def test_a_detached_rank_serves_as_its_policy_says_and_the_version_says_so(keep):
    """``reading`` (what ``weights()`` runs): while ``detached()`` names a reason, ``keep``
    serves the held version and the yielded ``ServedVersion`` carries the reason; ``block``
    waits, and is woken by ``Outcomes.changed`` once the rank is back (no poll, no timeout)."""
    from elastic_refit.runtime.serving import ServedVersion

    slot, outcomes, _ = _slot(staged=False)
    _refit(slot, 3)
    why: list[str | None] = ["no keepalive of its lease answered for 2.5 s (TTL 2 s)"]
    if keep:
        with slot.reading(lambda: why[0], keep=True, timeout_s=1.0) as served:
            assert isinstance(served, ServedVersion) and served == 3 and served.detached == why[0]
        return
    got: list[ServedVersion] = []
    reader = threading.Thread(target=lambda: got.append(_read_once(slot, lambda: why[0])))
    reader.start()
    time.sleep(0.3)
    assert got == []  # blocked while detached
    why[0] = None
    t0 = time.monotonic()
    outcomes.changed()  # what the rejoin, or etcd answering the lease's keepalive again, does
    reader.join(5.0)
    assert got == [3] and got[0].detached is None
    assert time.monotonic() - t0 < 1.0


def _read_once(slot: ServingSlot, detached):
    with slot.reading(detached, keep=False, timeout_s=30.0) as served:
        return served
