"""Lease keepalives of one process, sent from a thread and a gRPC channel of their own.

Why: a member's lease is its membership, and the client loop that used to send its
keepalives also runs the watch listeners, the leader, the suspicion loops and every etcd
call of the runtime. At 1,024 members in four processes a burst on that loop (a thousand
acks arriving, an epoch naming every member) delayed keepalives by about a second (p50
0.94 s) and leases of a 2 s TTL ran out during start-up and in the ack storm of a commit
round. The :class:`LeaseKeeper` runs on its own loop thread with its own channel, so
nothing queued on the client loop stands in front of a keepalive (the GIL still switches
every few milliseconds). It also costs less per lease: every lease due within a few
milliseconds goes out in one pass on one stream (no task, no timer and no retry wrapper
per keepalive), and etcd's answers, which come back in order per lease, are matched by
lease id.

The leases are spread over a few streams (``lease_id % num_streams``): etcd serves the
keepalives of one stream one after another, and each renewal first waits until etcd has
applied everything it committed. While a thousand members join, applies take milliseconds
each, and one stream per process renewed fewer leases per second than its members needed:
leases ran out with every keepalive sent in time. Renewals on separate streams wait for
the same apply together.

Semantics are a member's old keepalive loop's: a lease is renewed every
``interval_s``; only etcd answering TTL 0 (the lease is gone) calls ``on_lost``; while
etcd cannot be reached the keeper keeps trying (etcd keeps leases across its restarts)
and logs once per outage that outlives the TTL.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from aetcd import rpc
from elastic_refit.membership.client import EtcdClient, EtcdConfig

from elastic_refit.log import get_logger

# Leases due within this fraction of their interval go out in the same pass: one wake-up
# per ~5% of an interval, whatever the number of leases.
_BATCH_FRACTION = 0.05
_RETRY_S = 0.1  # a failed stream is re-opened after this long
NUM_STREAMS = 16  # keepalive streams per keeper at most (one is opened per lease id class in use)


@dataclass(slots=True)
class _Kept:
    lease_id: int
    ttl_s: float
    interval_s: float
    on_lost: Callable[[str], None]
    renewed_at: float  # monotonic: when the latest keepalive etcd answered was sent
    next_at: float  # monotonic: when the next keepalive is due
    sent: collections.deque[float] = field(default_factory=collections.deque)  # unanswered, oldest first
    outage_logged: bool = False
    on_back: Callable[[], None] | None = None  # an answer after no answer for longer than the TTL
    max_silent_s: float = 0.0  # the longest time from an answered keepalive's send to the next answer


class _Stream:
    """One ``LeaseKeepAlive`` stream: requests go out in order, answers come back in order."""

    def __init__(self, conn, index: int) -> None:
        self.conn = conn
        self.index = index
        self.broken: str | None = None
        self.unanswered = 0  # keepalives sent without an answer yet
        self.waiting_since = 0.0  # since when the stream owes an answer (monotonic)
        self._queue: asyncio.Queue = asyncio.Queue()
        self.call = conn.leasestub.LeaseKeepAlive(self._requests(), metadata=conn.metadata)

    async def _requests(self):
        while True:
            item = await self._queue.get()
            if item is None:
                return
            yield item

    def send(self, lease_id: int) -> None:
        self._queue.put_nowait(rpc.LeaseKeepAliveRequest(ID=lease_id))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._queue.put_nowait(None)
        self.call.cancel()


def lease_keeper(client: EtcdClient) -> LeaseKeeper:
    """The :class:`LeaseKeeper` that renews the leases of ``client``'s members, on a thread
    and a channel of its own (one per client, closed with it)."""
    return client.companion(LeaseKeeper)


class LeaseKeeper:
    """Keeps the leases of one process alive (see the module docstring).

    >>> keeper = LeaseKeeper(client.config)                        # doctest: +SKIP
    >>> keeper.keep(lease_id, ttl_s=2, interval_s=0.67, on_lost=print)  # doctest: +SKIP
    >>> keeper.release(lease_id); keeper.close()                    # doctest: +SKIP

    ``on_lost(reason)`` runs on the keeper's thread and must not block (hand it to your
    own loop or thread)."""

    def __init__(self, config: EtcdConfig, *, num_streams: int = NUM_STREAMS) -> None:
        if num_streams < 1:
            raise ValueError(f"num_streams must be >= 1, got {num_streams}")
        self._client = EtcdClient(config)  # its own loop thread and channel
        self._log = get_logger(component="lease-keeper")
        self._kept: dict[int, _Kept] = {}
        self._due: list[tuple[float, int]] = []  # (next_at, lease_id), a heap; stale entries skipped
        self._wake: asyncio.Event | None = None
        self._streams: list[_Stream | None] = [None] * num_streams  # lease_id % num_streams -> its stream
        self._closed = False
        self._lock = threading.Lock()
        self.keepalives_sent = 0
        self.streams_opened = 0
        # Seconds from each keepalive sent to its answer, the latest ones (diagnostics: etcd
        # serves a renewal only once it applied what it committed, so a write backlog in
        # etcd shows here before any lease runs out).
        self.latencies: collections.deque[float] = collections.deque(maxlen=8192)
        self._task = self._client.spawn(self._run(), name="lease-keeper")

    # ----------------------------------------------------------------- public
    def keep(self, lease_id: int, *, ttl_s: float, interval_s: float, on_lost: Callable[[str], None],
             renewed_at: float | None = None, on_back: Callable[[], None] | None = None) -> None:
        """Renew ``lease_id`` every ``interval_s`` from now on (``renewed_at``: when it was
        granted or last renewed, monotonic; default now). ``on_back()`` (keeper thread, must
        not block) runs on each answer that finds no keepalive answered for longer than
        ``ttl_s`` before it: etcd answers again and the lease lives (while ``renewed_at`` is
        still past the TTL, the next answer calls it again)."""
        if not 0 < interval_s < ttl_s:
            raise ValueError(f"need 0 < interval_s < ttl_s, got interval_s={interval_s} and ttl_s={ttl_s}")
        renewed = time.monotonic() if renewed_at is None else renewed_at
        # Due one interval after the grant (or last renewal), not after this call.
        kept = _Kept(lease_id, float(ttl_s), float(interval_s), on_lost, renewed, renewed + interval_s,
                     on_back=on_back)
        self._client.loop.call_soon_threadsafe(self._add, kept)

    def release(self, lease_id: int) -> None:
        """Stop renewing ``lease_id`` (before revoking it, or once it is lost)."""
        with contextlib.suppress(RuntimeError):  # the keeper's loop is closed already
            self._client.loop.call_soon_threadsafe(self._kept.pop, lease_id, None)

    def renewed_at(self, lease_id: int) -> float | None:
        """When the latest answered keepalive of ``lease_id`` was sent (monotonic)."""
        kept = self._kept.get(lease_id)
        return kept.renewed_at if kept is not None else None

    def max_silent_s(self, lease_id: int) -> float | None:
        """The longest etcd left ``lease_id`` without an answer so far: from the send of an
        answered keepalive to the next answer (an interval plus the answer's latency when
        all is well; past the TTL the lease may be gone). None once released or lost."""
        kept = self._kept.get(lease_id)
        return kept.max_silent_s if kept is not None else None

    @property
    def num_leases(self) -> int:
        return len(self._kept)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._client.close()

    # -------------------------------------------------------------- the loop
    def _add(self, kept: _Kept) -> None:
        self._kept[kept.lease_id] = kept
        heapq.heappush(self._due, (kept.next_at, kept.lease_id))
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        self._wake = asyncio.Event()
        while True:
            now = time.monotonic()
            for stream in self._streams:
                if stream is not None and (stream.broken is not None or self._stalled(stream, now)):
                    await self._drop_stream(stream, stream.broken or "no answer within the request timeout")
            missing = self._send_due(now, None)
            if missing:  # due leases whose stream is not open yet: connect and open them
                try:
                    missing = self._send_due(now, await self._client.connection())
                except Exception as exc:  # etcd unreachable: the due leases wait for the next pass
                    self._log.debug("membership.keepalive.stream_failed", error=repr(exc)[:200])
            wait = self._due[0][0] - time.monotonic() if self._due else None
            if missing:  # a stream could not be opened: retry soon, whatever is due next
                wait = _RETRY_S if wait is None else min(wait, _RETRY_S)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), None if wait is None else max(0.0, wait))

    def _send_due(self, now: float, conn) -> bool:
        """Send every keepalive due now (or within the batch window), opening missing
        streams on ``conn`` (None: open none); returns whether a due lease's stream is not
        open (it stays due)."""
        due = self._due
        late: list[tuple[float, int]] = []  # (seconds since renewed, lease) past their TTL
        deferred: list[tuple[float, int]] = []  # due, but their stream is not open
        while due:
            at, lease_id = due[0]
            kept = self._kept.get(lease_id)
            if kept is None or kept.next_at != at:
                heapq.heappop(due)  # released, or rescheduled since
                continue
            if at > now + _BATCH_FRACTION * kept.interval_s:
                break
            heapq.heappop(due)
            stream = self._stream_for(lease_id, conn)
            if stream is None:
                deferred.append((at, lease_id))
                continue
            stream.send(lease_id)
            self.keepalives_sent += 1
            if not stream.unanswered:
                stream.waiting_since = now
            stream.unanswered += 1
            kept.sent.append(now)
            kept.next_at = now + kept.interval_s
            heapq.heappush(due, (kept.next_at, lease_id))
            since = now - kept.renewed_at
            if since > kept.ttl_s and not kept.outage_logged:
                kept.outage_logged = True
                late.append((since, lease_id))
        for item in deferred:
            heapq.heappush(due, item)
        if late:  # one event per pass, not one per lease (a process may keep a thousand)
            self._log.warning("membership.keepalive.unreachable", num_leases=len(late), lease_id=max(late)[1],
                              seconds=round(max(late)[0], 3), error="no answer")
        return bool(deferred)

    def _stalled(self, stream: _Stream, now: float) -> bool:
        """The stream owes answers and gave none for longer than one request may take: it
        is stuck (a frozen etcd, a half-open connection)."""
        return stream.unanswered > 0 and now - stream.waiting_since > self._client.config.request_timeout_s

    def _stream_for(self, lease_id: int, conn) -> _Stream | None:
        """The open stream of ``lease_id``'s class, opened on ``conn`` if needed (None:
        etcd is unreachable at the moment)."""
        index = lease_id % len(self._streams)
        stream = self._streams[index]
        if stream is not None or conn is None:
            return stream
        try:
            stream = _Stream(conn, index)
        except Exception as exc:  # etcd unreachable: the next pass tries again
            self._log.debug("membership.keepalive.stream_failed", error=repr(exc)[:200])
            return None
        self._streams[index] = stream
        self.streams_opened += 1
        self._client.spawn_here(self._read(stream), "lease-keeper-read")
        return stream

    async def _drop_stream(self, stream: _Stream, reason: str) -> None:
        if self._streams[stream.index] is stream:
            self._streams[stream.index] = None
        stream.close()
        for kept in self._kept.values():
            if kept.lease_id % len(self._streams) == stream.index:
                kept.sent.clear()  # never answered: the lease stays due at its next time
        self._log.info("membership.keepalive.stream_reopened", reason=reason[:200], stream=stream.index)
        await self._client._rotate(stream.conn)  # another endpoint, if there is one

    async def _read(self, stream: _Stream) -> None:
        try:
            while True:
                reply = await stream.call.read()
                if reply is grpc.aio.EOF:
                    raise ConnectionError("lease keepalive stream closed by server")
                if stream.unanswered:
                    stream.unanswered -= 1
                    stream.waiting_since = time.monotonic()
                kept = self._kept.get(int(reply.ID))
                if kept is None:
                    continue  # released meanwhile
                sent = kept.sent.popleft() if kept.sent else kept.renewed_at
                self.latencies.append(time.monotonic() - sent)
                if reply.TTL > 0:
                    silent = time.monotonic() - kept.renewed_at
                    kept.max_silent_s = max(kept.max_silent_s, silent)
                    back = silent > kept.ttl_s
                    kept.renewed_at = max(kept.renewed_at, sent)
                    kept.outage_logged = False
                    if back and kept.on_back is not None:
                        try:
                            kept.on_back()
                        except Exception:
                            self._log.exception("membership.keepalive.on_back_failed", lease_id=kept.lease_id)
                    continue
                del self._kept[kept.lease_id]
                reason = (f"lease {kept.lease_id} expired (last keepalive "
                          f"{time.monotonic() - kept.renewed_at:.2f}s ago)")
                try:
                    kept.on_lost(reason)
                except Exception:
                    self._log.exception("membership.keepalive.on_lost_failed", lease_id=kept.lease_id)
        except asyncio.CancelledError:
            if stream.broken is None:
                stream.broken = "cancelled"
            raise
        except Exception as exc:
            stream.broken = f"{type(exc).__name__}: {exc}"[:300]
            if self._wake is not None:
                self._wake.set()
