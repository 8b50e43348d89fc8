"""List-then-watch of a key range, kept as a local cache that survives etcd trouble.

The watcher lists ``[start, end)`` once, then watches from the next revision. When the
stream breaks (etcd restart, leader change, network) it re-opens from the last revision
it has seen, so no event is lost or applied twice. When that revision was compacted it
relists and tells listeners the cache was reset. It asks the server for a progress
notification every ``progress_interval_s``; no answer within ``stall_timeout_s`` means
the stream is stalled (a frozen etcd member, a half-open TCP connection) and it is
re-opened, possibly at another endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import aetcd.exceptions as aetcd_exc
import grpc
from aetcd import rpc
from elastic_refit.membership.client import EtcdClient, Get, KeyValue, _b
from elastic_refit.membership.errors import EtcdUnavailable, JobStateLost, MembershipError

from elastic_refit.log import get_logger


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change in the watched range (``kind`` is ``put`` or ``delete``)."""

    kind: str
    key: str
    kv: KeyValue | None  # None for deletes
    revision: int


@dataclass(frozen=True, slots=True)
class RangeSnapshot:
    """The cached range at ``revision``: key -> KeyValue."""

    revision: int
    items: dict[str, KeyValue]


class WatchStalled(MembershipError):
    """The watch stream answered neither events nor progress requests in time."""


class _Compacted(Exception):
    def __init__(self, compact_revision: int):
        super().__init__(f"watch start revision compacted (compact_revision={compact_revision})")
        self.compact_revision = compact_revision


T = TypeVar("T")

Listener = Callable[[bool, list[WatchEvent], RangeSnapshot], None]


class RangeWatcher:
    """A local, always-converging copy of the keys in ``[start, end)``.

    ``listeners`` run on the client loop thread after each change, with
    ``(reset, events, snapshot)``; ``reset`` is True after a (re)list. They must not block.
    """

    def __init__(self, client: EtcdClient, start: str, end: str, *, name: str = "watch",
                 start_revision: int | None = None, progress_interval_s: float = 1.0,
                 stall_timeout_s: float = 3.0):
        if progress_interval_s <= 0 or stall_timeout_s <= progress_interval_s:
            raise ValueError(
                "need 0 < progress_interval_s < stall_timeout_s, got "
                f"{progress_interval_s} and {stall_timeout_s}"
            )
        if start >= end:
            raise ValueError(f"watch range must be non-empty, got [{start!r}, {end!r})")
        self._client = client
        self.start_key = start
        self.end_key = end
        self.name = name
        self._progress_interval_s = progress_interval_s
        self._stall_timeout_s = stall_timeout_s
        self._items: dict[str, KeyValue] = {}
        # The snapshot of the current revision, built once and shared by every reader until
        # the next change (a copy per reader is O(keys) each: O(members^2) per change when
        # many members share one watch).
        self._snap: RangeSnapshot | None = None
        # key -> (mod_revision, decoder, decoded value): see decoded()
        self._decoded: dict[str, tuple[int, Callable[[bytes], object], object]] = {}
        # name -> (snapshot, value): see derived()
        self._derived: dict[str, tuple[RangeSnapshot, object]] = {}
        # A caller may resume from a revision it saved; None lists first.
        self._revision = start_revision - 1 if start_revision else 0
        self._need_list = start_revision is None
        self._cond = threading.Condition()
        self._listeners: list[Listener] = []
        self._task: asyncio.Future | None = None
        self._ready = threading.Event()
        self._stopped = False
        self.relists = 0
        self.reconnects = 0
        self.stalls = 0
        self._stalled_in_a_row = 0  # stalls since the last response (see _run)
        self.progress_responses = 0
        self.last_response_at = 0.0
        self._log = get_logger(component="watch", watch=name)

    # ------------------------------------------------------------------ public
    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def start(self, timeout_s: float = 10.0, *, revision: int = 0) -> RangeWatcher:
        """Start watching; returns once the first list (or resume) is in place and, given a
        ``revision`` of a write inside the range, once the cache includes it."""
        self._task = self._client.spawn(self._run(), name=f"watch:{self.name}")
        if not self._ready.wait(timeout_s):
            raise EtcdUnavailable(self._client.config.targets, f"watch {self.name} start",
                                  None)
        if revision:
            self.wait_for(lambda snap: snap.revision >= revision, timeout_s)
        return self

    def stop(self) -> None:
        self._stopped = True
        if self._task is not None:
            self._client.loop.call_soon_threadsafe(self._task.cancel)

    @property
    def revision(self) -> int:
        with self._cond:
            return self._revision

    def snapshot(self) -> RangeSnapshot:
        """The cached range now. Shared with other readers until the next change: treat
        its ``items`` as read-only."""
        with self._cond:
            return self._current()

    def decoded(self, kv: KeyValue, decode: Callable[[bytes], T]) -> T:
        """``decode(kv.value)``, computed once per key and ``mod_revision`` and shared by
        every caller (a large value, such as an epoch naming 1,024 members, costs
        milliseconds to decode: once per change, not once per member)."""
        with self._cond:
            memo = self._decoded.get(kv.key)
            if memo is not None and memo[0] == kv.mod_revision and memo[1] == decode:  # bound methods: ==
                return memo[2]  # type: ignore[return-value]
        value = decode(kv.value)
        with self._cond:
            self._decoded[kv.key] = (kv.mod_revision, decode, value)
        return value

    def derived(self, name: str, snap: RangeSnapshot, compute: Callable[[RangeSnapshot], T]) -> T:
        """``compute(snap)``, computed once per snapshot and shared by every caller that
        asks under ``name`` (e.g. the members' leases by id, or the liveness ring's order):
        the members of one process share this watcher, and an index each of them built on
        every change was O(members) per member, O(members^2) per change for the process.
        ``name`` names the computation: ``compute`` must be pure and the same for a name."""
        with self._cond:
            memo = self._derived.get(name)
            if memo is not None and memo[0] is snap:
                return memo[1]  # type: ignore[return-value]
        value = compute(snap)
        with self._cond:
            self._derived[name] = (snap, value)
        return value

    def _current(self) -> RangeSnapshot:
        # (under _cond)
        if self._snap is None or self._snap.revision != self._revision:
            self._snap = RangeSnapshot(self._revision, dict(self._items))
        return self._snap

    def _changed(self) -> None:
        # (under _cond) the items changed: the next snapshot is a new copy
        self._snap = None

    def wait_for(self, predicate: Callable[[RangeSnapshot], bool], timeout_s: float) -> RangeSnapshot:
        """Block until ``predicate(snapshot)`` holds; ``TimeoutError`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                snap = self._current()
                if predicate(snap):
                    return snap
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"watch {self.name}: condition not met within {timeout_s}s "
                                       f"(revision {self._revision}, {len(self._items)} keys)")
                self._cond.wait(left)

    # ---------------------------------------------------------------- internals
    def _notify(self, reset: bool, events: list[WatchEvent]) -> None:
        with self._cond:
            snap = self._current()
            self._cond.notify_all()
        for listener in list(self._listeners):
            try:
                listener(reset, events, snap)
            except Exception:  # a listener bug must not kill the watch
                self._log.exception("membership.watch.listener_failed")

    async def _list(self) -> None:
        res = await self._client.arange(self.start_key, self.end_key)
        with self._cond:
            self._items = {kv.key: kv for kv in res.kvs}
            self._revision = res.revision
            self._changed()
        self.relists += 1
        self._log.info("membership.watch.listed", keys=len(res.kvs), revision=res.revision)
        self._notify(True, [])

    async def _run(self) -> None:
        backoff = 0.05
        while not self._stopped:
            try:
                if self._need_list:
                    await self._list()
                    self._need_list = False
                self._ready.set()
                await self._stream()
                backoff = 0.05
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._stopped or task is None or task.cancelling():
                    raise
                # grpc.aio cancels RPCs of a channel that another task closed (endpoint
                # rotation): that is a broken stream, not a request to stop watching.
                self.reconnects += 1
                self._log.warning("membership.watch.interrupted", revision=self._revision,
                                  error="stream cancelled by channel close", retry_in_s=0.05)
                await asyncio.sleep(0.05)
            except _Compacted as exc:
                self._log.warning("membership.watch.compacted", revision=self._revision,
                                  compact_revision=exc.compact_revision)
                self._need_list = True
            except JobStateLost as exc:  # etcd went back (membership.revisions): nothing to watch
                self._log.error("membership.watch.stopped", revision=self._revision, error=str(exc)[:300])
                return
            except Exception as exc:  # any fault: the watch must outlive it
                self.reconnects += 1
                if isinstance(exc, WatchStalled):
                    self.stalls += 1
                    self._stalled_in_a_row += 1
                self._log.warning("membership.watch.interrupted", revision=self._revision,
                                  error=f"{type(exc).__name__}: {exc}"[:300],
                                  retry_in_s=backoff)
                single = len(self._client.config.targets) == 1
                # A single endpoint's first stall re-opens the stream only: closing the
                # channel fails every request in flight on it, and a stall is mostly a slow
                # (loaded) server or client. A dead connection fails on gRPC's keepalive, or
                # stalls again, and then the channel is replaced.
                if isinstance(exc, aetcd_exc.ConnectionFailedError | grpc.RpcError) or (
                        isinstance(exc, WatchStalled) and (not single or self._stalled_in_a_row > 1)):
                    await self._client._rotate(None if single else self._client._conn)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    async def _stream(self) -> None:
        conn = await self._client.connection()
        stub = rpc.WatchStub(conn.channel)
        queue: asyncio.Queue = asyncio.Queue()
        create = rpc.WatchCreateRequest(key=_b(self.start_key), range_end=_b(self.end_key),
                                        start_revision=self._revision + 1,
                                        progress_notify=True)
        await queue.put(rpc.WatchRequest(create_request=create))

        async def requests():
            while True:
                item = await queue.get()
                if item is None:
                    return
                yield item

        call = stub.Watch(requests(), metadata=conn.metadata)
        self.last_response_at = time.monotonic()

        async def ask_progress() -> None:
            while True:
                await asyncio.sleep(self._progress_interval_s)
                await queue.put(rpc.WatchRequest(progress_request=rpc.WatchProgressRequest()))

        pinger = asyncio.ensure_future(ask_progress())
        created = False
        # What this process had seen when the stream opened: a stream opened on etcd restored
        # from an older copy answers below it even where this watcher's own range saw no
        # write since (its revision lags the process's), and nothing else may ask etcd.
        guard = self._client.revisions
        floor = guard.highest if guard is not None else 0
        try:
            while True:
                try:
                    resp = await asyncio.wait_for(call.read(), self._stall_timeout_s)
                except TimeoutError:
                    raise WatchStalled(
                        f"no watch response for {self._stall_timeout_s}s at "
                        f"{self._client.endpoint}") from None
                if resp is grpc.aio.EOF:
                    raise aetcd_exc.ConnectionFailedError("watch stream closed by server")
                self.last_response_at = time.monotonic()
                self._stalled_in_a_row = 0
                if resp.compact_revision:
                    raise _Compacted(resp.compact_revision)
                if resp.canceled:
                    raise aetcd_exc.ConnectionFailedError(
                        f"watch canceled by server: {resp.cancel_reason!r}")
                if resp.header.revision < max(self._revision, floor if resp.created else 0):
                    await self._confirm_not_behind()
                if resp.created and not created:
                    created = True
                    if self.reconnects:
                        self._log.info("membership.watch.resumed", revision=self._revision,
                                       endpoint=self._client.endpoint)
                        await self._verify_resumed()
                    continue
                if resp.events:
                    self._apply(resp.events)
                else:
                    # A progress answer proves the stream is alive. Its revision is not
                    # used to advance ours: etcd before 3.4.24 / 3.5.8 could report a
                    # progress revision ahead of events still queued for this watcher
                    # (etcd-io/etcd#15220), and trusting it loses those events.
                    self.progress_responses += 1
        finally:
            pinger.cancel()
            # Awaited, so that a client closing its loop right after never destroys the
            # pinger still pending ("Task was destroyed but it is pending!").
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pinger
            with contextlib.suppress(Exception):
                await queue.put(None)
            call.cancel()

    async def _verify_resumed(self, newest: int = 8) -> None:
        """After a stream resumed (etcd restarted, a reconnect): the ``newest`` keys this
        watcher holds (by modification revision), read linearizably in one transaction. One
        that etcd holds modified before the write this watcher saw means the store went back
        (``JobStateLost``, see ``membership.revisions``): found even when the restored store
        took writes past every revision this process saw before it asked, which the revision
        check alone misses, and when no later write touches the watched range (its events
        alone would never show it). A key etcd no longer holds may have been deleted while
        the stream was down: its delete event follows."""
        guard = self._client.revisions
        if guard is None:
            return
        with self._cond:
            held = sorted(self._items.values(), key=lambda kv: kv.mod_revision, reverse=True)[:newest]
        if not held:
            return
        res = await self._client.atxn([], [Get(kv.key) for kv in held])
        for kv, got in zip(held, res.gets, strict=True):
            if got:
                guard.key_went_back(kv.key, got[0].mod_revision, kv.mod_revision, self._client.endpoint)

    async def _confirm_not_behind(self) -> None:
        """A watch answer below this watcher's revision: a lagging cluster member, or etcd
        restored from an older state. A monotonic client tells them apart with one
        linearizable read (``JobStateLost`` when the store went back, see
        ``membership.revisions``)."""
        guard = self._client.revisions
        if guard is not None:
            guard.floor(self._revision)
            await self._client.arevision()

    def _apply(self, pb_events) -> None:
        events: list[WatchEvent] = []
        with self._cond:
            for ev in pb_events:
                key = ev.kv.key.decode()
                rev = ev.kv.mod_revision
                if rev <= self._revision:
                    continue  # already applied before a reconnect
                if ev.type == rpc.Event.PUT:
                    kv = KeyValue.from_pb(ev.kv)
                    self._items[key] = kv
                    events.append(WatchEvent("put", key, kv, rev))
                else:
                    self._items.pop(key, None)
                    events.append(WatchEvent("delete", key, None, rev))
            if events:
                self._revision = max(self._revision, max(e.revision for e in events))
                self._changed()
        if events:
            self._notify(False, events)


class WatchHub:
    """One list-then-watch stream of ``[start, end)`` shared by many consumers of one
    process (e.g. every member a process simulates, or several agents of one host).

    Each consumer takes a :meth:`view`, which looks like a :class:`RangeWatcher` (listeners,
    ``snapshot``, ``revision``, ``wait_for``, ``decoded``) but costs no stream, no list and
    no copy of its own: etcd sends each change once per process, not once per consumer.
    Stopping a view detaches it; :meth:`close` stops the stream.
    """

    def __init__(self, client: EtcdClient, start: str, end: str, *, name: str = "hub",
                 progress_interval_s: float = 1.0, stall_timeout_s: float = 3.0, batch_s: float = 0.01):
        """``batch_s``: changes that arrive within this long reach the consumers as one
        delivery (0: one delivery per change). A process of many consumers does work per
        consumer per delivery: a thousand members joining within seconds, one delivery
        each, was O(members^2) per process and starved its lease keeper of the GIL."""
        if batch_s < 0:
            raise ValueError(f"batch_s must be >= 0, got {batch_s}")
        self._client = client
        self._batch_s = batch_s
        # Changes not delivered yet: (reset, events, latest snapshot); events merged in place.
        self._pending: tuple[bool, list[WatchEvent], RangeSnapshot] | None = None
        self.watcher = RangeWatcher(client, start, end, name=name, progress_interval_s=progress_interval_s,
                                    stall_timeout_s=stall_timeout_s)
        self.watcher.add_listener(self._dispatch)
        # Replaced, never mutated, on the loop thread: dispatch iterates a stable tuple.
        self._views: tuple[SharedRange, ...] = ()
        self._start_lock = threading.Lock()
        self._started = False

    def view(self) -> SharedRange:
        """A new consumer of this stream (detached until its ``start``)."""
        return SharedRange(self)

    def start(self, timeout_s: float = 10.0) -> WatchHub:
        """Start the stream (once); returns when its first list is in place."""
        with self._start_lock:
            if not self._started:
                self.watcher.start(timeout_s)
                self._started = True
        return self

    def close(self) -> None:
        self.watcher.stop()
        self._views = ()

    @property
    def num_views(self) -> int:
        return len(self._views)

    def _dispatch(self, reset: bool, events: list[WatchEvent], snap: RangeSnapshot) -> None:
        # (loop thread) Merged with what is pending: a reset makes the delivery a reset
        # (consumers re-read the snapshot), else the events are concatenated in order.
        if self._batch_s == 0:
            self._deliver_all(reset, events, snap)
            return
        if self._pending is None:
            self._pending = (reset, [] if reset else list(events), snap)
            self._client.loop.call_later(self._batch_s, self._flush)
            return
        was_reset, pending, _ = self._pending
        if reset or was_reset:
            self._pending = (True, [], snap)
        else:
            pending.extend(events)  # our own list: a burst costs O(events), not O(events^2)
            self._pending = (False, pending, snap)

    def _flush(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._deliver_all(*pending)

    def _deliver_all(self, reset: bool, events: list[WatchEvent], snap: RangeSnapshot) -> None:
        for view in self._views:
            view._deliver(reset, events, snap)

    def _attach(self, view: SharedRange) -> None:
        # On the loop thread, so no change can land between the first snapshot a view sees
        # and the first event it is given (pending changes go out first: the new view's
        # snapshot holds them already).
        self._flush()
        self._views = (*self._views, view)
        view._deliver(True, [], self.watcher.snapshot())

    def _detach(self, view: SharedRange) -> None:
        self._views = tuple(v for v in self._views if v is not view)


class SharedRange:
    """One consumer's handle on a :class:`WatchHub` (see there)."""

    def __init__(self, hub: WatchHub):
        self._hub = hub
        self._listeners: list[Listener] = []
        self._stopped = False
        self.name = hub.watcher.name

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def start(self, timeout_s: float = 10.0, *, revision: int = 0) -> SharedRange:
        """Attach to the hub (starting it if needed); listeners first see a reset with the
        current snapshot, on the client loop thread, before this returns. ``revision``: a
        write inside the range (e.g. this member's own key) the first snapshot must include:
        the shared stream may not have delivered it yet, where a watch of one's own lists
        after it."""
        self._hub.start(timeout_s)
        if revision:
            self._hub.watcher.wait_for(lambda snap: snap.revision >= revision, timeout_s)
        client = self._hub._client

        async def attach() -> None:
            self._hub._attach(self)

        client.run(attach(), timeout_s=timeout_s)
        return self

    def stop(self) -> None:
        self._stopped = True
        self._hub._client.loop.call_soon_threadsafe(self._hub._detach, self)

    def _deliver(self, reset: bool, events: list[WatchEvent], snap: RangeSnapshot) -> None:
        if self._stopped:
            return
        for listener in list(self._listeners):
            try:
                listener(reset, events, snap)
            except Exception:  # one consumer's bug must not starve the others
                self._hub.watcher._log.exception("membership.watch.listener_failed")

    # The read side of RangeWatcher, served from the shared cache.
    @property
    def revision(self) -> int:
        return self._hub.watcher.revision

    def snapshot(self) -> RangeSnapshot:
        return self._hub.watcher.snapshot()

    def wait_for(self, predicate: Callable[[RangeSnapshot], bool], timeout_s: float) -> RangeSnapshot:
        return self._hub.watcher.wait_for(predicate, timeout_s)

    def decoded(self, kv: KeyValue, decode: Callable[[bytes], T]) -> T:
        return self._hub.watcher.decoded(kv, decode)

    def derived(self, name: str, snap: RangeSnapshot, compute: Callable[[RangeSnapshot], T]) -> T:
        return self._hub.watcher.derived(name, snap, compute)

    @property
    def relists(self) -> int:
        return self._hub.watcher.relists

    @property
    def reconnects(self) -> int:
        return self._hub.watcher.reconnects
