"""The CPU sampler the RL bench uses to tell where a refit's cost to generation goes, and its
summary beside the refit windows (``testing.rl_run._cpu``)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from elastic_refit.testing.cpu_sampler import CpuSampler, host_jiffies, thread_seconds
from elastic_refit.testing.rl_run import _cpu

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@linux
def test_a_busy_thread_shows_by_name_and_an_idle_one_does_not():
    samples: list[dict] = []
    stop = threading.Event()

    def burn() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    burner = threading.Thread(target=burn, name="burner")
    sleeper = threading.Thread(target=stop.wait, name="sleeper")
    with CpuSampler(samples.append, interval_s=0.1):
        burner.start()
        sleeper.start()
        time.sleep(1.0)
        stop.set()
        burner.join()
        sleeper.join()
    assert len(samples) >= 2  # the sampler waits for the GIL behind the burner too
    assert all(0.0 <= s["host_busy"] <= 1.0 and s["seconds"] > 0 for s in samples if "host_busy" in s)
    burned = [s["threads"].get("burner", 0.0) for s in samples]
    # The GIL shares one core between the burner and the main thread's sleeps: well above
    # nothing, never above one core (jiffies are 10 ms: a 0.1 s sample may read 1.1).
    assert max(burned) >= 0.5 and max(burned) <= 1.2, burned
    assert all(s["threads"].get("sleeper", 0.0) <= 0.1 for s in samples), samples


@linux
def test_thread_seconds_and_host_jiffies_read_this_process_and_host():
    busy, total = host_jiffies()
    assert 0 < busy <= total
    assert thread_seconds().get("MainThread", 0.0) > 0.0  # this test process has run a while


def test_bad_interval_is_refused():
    with pytest.raises(ValueError, match="interval_s"):
        CpuSampler(lambda s: None, interval_s=0)


def test_samples_split_by_the_refit_windows_they_fall_in():
    windows = [{"kind": "refit.event", "event": "refit.transfer.done", "at": 10.0, "seconds": 2.0}]
    samples = [{"kind": "cpu", "t": t, "seconds": 0.5, "host_busy": busy, "host_cores": 16,
                "threads": {"MainThread": main, "NCCL Proxy": proxy}}
               for t, busy, main, proxy in ((7.5, 0.1, 1.0, 0.0), (8.5, 0.5, 0.6, 2.0), (9.5, 0.7, 0.4, 3.0),
                                            (11.0, 0.2, 1.0, 0.0))]
    out = _cpu("async-staged", windows + samples)
    assert out["refit"]["samples"] == 2 and out["idle"]["samples"] == 2
    assert out["refit"]["host_busy"] == pytest.approx(0.6) and out["idle"]["host_busy"] == pytest.approx(0.15)
    assert out["refit"]["threads"]["MainThread"] == pytest.approx(0.5)
    assert out["top"][0] == ("NCCL Proxy", pytest.approx(2.5), pytest.approx(0.0))
    assert out["host_cores"] == 16
    assert _cpu("async-staged", windows) == {}  # no samples: nothing to say
