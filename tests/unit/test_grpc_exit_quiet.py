"""No gRPC traceback at exit: about one run in twelve printed "Exception in callback
PollerCompletionQueue._handle_events ... RuntimeError: Event loop is closed" as it ended.

gRPC's asyncio poller is shared by every loop of a process; the loop that reads an event
hands it to its call's loop, and that loop may be closed already (a client closed at exit).
The report arrives on a client's loop through asyncio's callback error path, as here: a
callback of that name raising on the loop. It must be dropped; other errors must not."""

from __future__ import annotations

import threading

from elastic_refit.membership import EtcdClient


def _run_on(client: EtcdClient, exc: BaseException) -> None:
    done = threading.Event()

    def _handle_events() -> None:  # named as gRPC's poller callback is
        try:
            raise exc
        finally:
            client.loop.call_soon(done.set)

    _handle_events.__qualname__ = "PollerCompletionQueue._handle_events"
    client.loop.call_soon_threadsafe(_handle_events)
    assert done.wait(5)


def test_the_poller_s_closed_loop_report_is_dropped_and_other_errors_are_not(caplog):
    """asyncio reports a callback's exception through its logger (printed with the traceback
    to stderr at exit, when nothing else configured logging)."""
    client = EtcdClient(["127.0.0.1:1"])  # no request is made: only its loop is used
    try:
        with caplog.at_level("ERROR", logger="asyncio"):
            _run_on(client, RuntimeError("Event loop is closed"))
            _run_on(client, BlockingIOError(11, "Resource temporarily unavailable"))
            assert [r for r in caplog.records if r.name == "asyncio"] == []
            _run_on(client, ValueError("something else"))
            (record,) = [r for r in caplog.records if r.name == "asyncio"]
            assert record.exc_info is not None and isinstance(record.exc_info[1], ValueError)
    finally:
        client.close()
