"""A reader held on one inference rank delays only that rank.

Real etcd, real gloo; the members run in this process. i0's engine holds ``weights()`` for
``HOLD_S`` while the trainer publishes the next version. Before issue 34, in ``in_place``
mode the refit's transfer timed out on every rank (an error that did not name the reader),
again and again, and i1, holding no reader, served nothing meanwhile: it had started writing
its parameters. Now an in-place destination waits for its readers before it agrees on a
plan (nothing is written anywhere yet, i1 goes on serving the version it holds), and gives
the attempt up naming the reader and how long it held; in ``staged`` mode i1 serves the new
version at once and i0 switches it in as its reader leaves.
"""

from __future__ import annotations

import threading
import time

import pytest

from .test_rejoin import publish, small_job

pytestmark = pytest.mark.etcd

HOLD_S = 5.0


def hold_weights(engine, entered: threading.Event, seconds: float) -> threading.Thread:
    def read() -> None:
        with engine.weights():
            entered.set()
            time.sleep(seconds)

    t = threading.Thread(target=read, name="reader-i0", daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("mode", ["in_place", "staged"])
def test_a_reader_held_on_one_rank_leaves_the_others_serving(etcd_server, job, mode):
    with small_job(etcd_server.endpoint, job, mode=mode) as (trainer, engines, _params):
        i0, i1 = engines
        publish(trainer, 1)
        for engine in engines:
            engine.wait_for_version(1)
        entered = threading.Event()
        reader = hold_weights(i0, entered, HOLD_S)
        assert entered.wait(10)
        held_at = time.monotonic()
        publishing = threading.Thread(target=publish, args=(trainer, 2), daemon=True)
        publishing.start()
        # While i0's reader holds: i1 serves on, without waiting.
        slowest, served = 0.0, set()
        while time.monotonic() - held_at < HOLD_S - 1.0:
            t0 = time.monotonic()
            with i1.weights(timeout_s=HOLD_S) as version:
                served.add(version)
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.05)
        assert slowest < 0.5, f"i1 waited {slowest:.2f} s for its weights while i0's reader held ({mode})"
        if mode == "staged":
            assert 2 in served, f"staged: i1 serves version 2 while i0's reader holds, served {served}"
        reader.join(HOLD_S + 5)
        publishing.join(30)
        assert not publishing.is_alive(), "version 2 did not commit once the reader left"
        assert i0.wait_for_version(2, timeout_s=10) == 2 and i1.wait_for_version(2, timeout_s=10) == 2
        committed_after = time.monotonic() - held_at
        print(f"{mode}: version 2 served everywhere {committed_after:.2f} s after i0's reader entered "
              f"(held {HOLD_S} s); i1's slowest weights() meanwhile {slowest:.3f} s, versions {sorted(served)}")
