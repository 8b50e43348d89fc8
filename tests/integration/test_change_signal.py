"""ChangeSignal on a real etcd: the agent's wakeups come from watches, none is lost."""

from __future__ import annotations

import threading

import pytest
from elastic_refit.membership.wakeup import ChangeSignal


@pytest.fixture
def signal(etcd_server, make_client):
    client = make_client(etcd_server.endpoints)
    changes = ChangeSignal(client, progress_interval_s=0.5, stall_timeout_s=2.0)
    yield client, changes
    changes.close()


def test_a_change_under_a_watched_prefix_wakes_and_one_elsewhere_does_not(signal, job):
    client, changes = signal
    changes.watch("versions", f"/{job}/versions/")
    token = changes.token()
    client.put(f"/{job}/other/key", b"x")
    assert not changes.wait_after(token, 0.5), "a key outside the watched prefix woke the waiter"
    client.put(f"/{job}/versions/1/committed", b"{}")
    assert changes.wait_after(token, 10.0), "a put under the watched prefix did not wake the waiter"
    token = changes.token()
    client.delete(f"/{job}/versions/1/committed")
    assert changes.wait_after(token, 10.0), "a delete under the watched prefix did not wake the waiter"


def test_a_change_between_the_token_and_the_wait_is_not_lost(signal, job):
    client, changes = signal
    changes.watch("versions", f"/{job}/versions/")
    token = changes.token()  # the agent reads its state after this ...
    client.put(f"/{job}/versions/2/sources/t0", b"{}")
    seen = threading.Event()
    threading.Thread(target=lambda: seen.set() if changes.wait_after(token, 10.0) else None).start()
    assert seen.wait(10.0), "the change before the wait was lost"  # ... and never sleeps past it


def test_a_replaced_watch_follows_the_new_prefix_only(signal, job):
    client, changes = signal
    changes.watch("epoch", f"/{job}/store/1/")
    changes.watch("epoch", f"/{job}/store/2/")  # the next epoch's store
    token = changes.token()
    client.put(f"/{job}/store/1/done/a", b"ok")
    assert not changes.wait_after(token, 0.5), "the old epoch's store still wakes the waiter"
    client.put(f"/{job}/store/2/done/a", b"ok")
    assert changes.wait_after(token, 10.0)


def test_close_releases_a_waiter(signal):
    _, changes = signal
    token = changes.token()
    changes.close()
    assert changes.wait_after(token, 10.0)
