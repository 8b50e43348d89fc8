"""py-spy sampling a real process's GIL (``testing.gil_sampler``): a thread that holds it is
measured, one that sleeps is not. Skipped without py-spy, or where ptrace is refused."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from elastic_refit.testing.gil_sampler import GilSampler


@pytest.fixture
def pyspy() -> str:
    found = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if found is None:
        pytest.skip("py-spy is not installed (pip install py-spy)")
    return found


def _started(code: str) -> subprocess.Popen:
    """A Python child running ``code``, once it printed "ready" (py-spy needs the
    interpreter up to attach)."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="py-spy attaches with ptrace")
def test_a_thread_that_holds_the_gil_is_measured_and_one_that_sleeps_is_not(tmp_path, pyspy):
    child = _started("""\
        import threading, time
        def burn():
            end = time.time() + 2.5
            while time.time() < end:
                sum(range(100))
        threading.Thread(target=burn, name="burner").start()
        threading.Thread(target=time.sleep, args=(2.5,), name="sleeper").start()
        print("ready", flush=True)
        time.sleep(2.6)
        """)
    try:
        sampler = GilSampler(pyspy, child.pid, str(tmp_path / "gil.txt"), duration_s=2, rate=100)
        held, error = sampler.result()
    finally:
        child.wait(10)
    if error is not None and ("ermission" in error or "ptrace" in error.lower()):
        pytest.skip(f"py-spy may not attach here: {error}")
    assert error is None, error
    # The burner holds the GIL most of the 2 s sampled; the sleeper never does.
    assert held.get("burner", 0.0) > 1.0, held
    assert held.get("sleeper", 0.0) == 0.0, held


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="py-spy attaches with ptrace")
def test_a_hung_process_s_stacks_say_where_it_waits(tmp_path, pyspy):
    from elastic_refit.testing.gil_sampler import dump_stacks

    child = _started("""\
        import threading, time
        def waiting_for_the_peer():
            time.sleep(30)
        threading.Thread(target=waiting_for_the_peer, name="refit-agent-t0", daemon=True).start()
        print("ready", flush=True)
        time.sleep(30)
        """)
    try:
        out = tmp_path / "stacks-t0.txt"
        why = dump_stacks(pyspy, child.pid, str(out))
    finally:
        child.kill()
        child.wait(10)
    if why is not None and ("ermission" in why or "ptrace" in why.lower()):
        pytest.skip(f"py-spy may not attach here: {why}")
    assert why is None, why
    stacks = out.read_text()
    assert "refit-agent-t0" in stacks and "waiting_for_the_peer" in stacks, stacks
    gone = dump_stacks(pyspy, child.pid, str(tmp_path / "gone.txt"))
    assert gone is not None and not (tmp_path / "gone.txt").exists()  # the process is gone: said, not written
