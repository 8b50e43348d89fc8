"""A small synchronous adapter over aetcd (asyncio etcd v3 client).

Why an adapter: the rest of the runtime is synchronous (torch.distributed calls a Store
from C++ threads), etcd must be reachable through a list of endpoints with TLS and auth
passed through, transient failures need bounded retries, and callers want one typed
error (:class:`~membership.errors.EtcdUnavailable`) naming the endpoints, not gRPC codes.

Each :class:`EtcdClient` owns one asyncio loop on a daemon thread; background work (watches,
the leader loop) runs as tasks on that loop, and the sync methods submit coroutines to it.
Lease keepalives are not among them: a :class:`~membership.leases.LeaseKeeper` sends them
from a thread and channel of its own, so a busy loop cannot starve them. Create clients inside each process: gRPC channels do not
survive ``fork()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions as aetcd_exc
import grpc
from aetcd import rpc
from elastic_refit.membership.errors import EtcdAccessDenied, EtcdUnavailable
from elastic_refit.membership.revisions import RevisionGuard
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
)

from elastic_refit.log import get_logger

T = TypeVar("T")

# Faults worth another attempt (possibly at another endpoint); anything else is a bug or
# a server-side refusal and surfaces at once.
# etcd's messages for a wrong password, a missing user or token, and a key outside the roles.
_ACCESS_DENIED = ("authentication failed", "permission denied", "user name is empty", "invalid auth token",
                  "user name not found")

_TRANSIENT = (
    aetcd_exc.ConnectionFailedError,
    aetcd_exc.ConnectionTimeoutError,
    asyncio.TimeoutError,
)


def _quiet_grpc_poller(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The client loops' exception handler: drop two harmless reports of gRPC's shared poller.

    gRPC's asyncio completion queue is one per process, read by every loop that uses gRPC
    (each client has one, so does its lease keeper). The loop that reads an event hands it to
    the loop of the call it belongs to; when that loop was closed (a client closed at exit, its
    last events still in flight) the hand-over raises "Event loop is closed", and a loop that
    woke for an event another loop took raises BlockingIOError (grpc/grpc#25364). Both were
    printed as tracebacks at exit; anything else is reported as asyncio would."""
    exc = context.get("exception")
    if "PollerCompletionQueue._handle_events" in str(context.get("message", "")) and (
            isinstance(exc, BlockingIOError) or (isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc))):
        return
    loop.default_exception_handler(context)


def _prefix_end(prefix: bytes) -> bytes:
    return aetcd.utils.prefix_range_end(prefix)


def _b(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _key_range(key: str, *, prefix: bool = False, end: str | None = None) -> dict[str, bytes]:
    """The ``key`` and ``range_end`` fields of a range or delete request: ``key`` alone,
    every key under the prefix ``key``, or the keys in ``[key, end)``."""
    if prefix:
        return {"key": _b(key), "range_end": _prefix_end(_b(key))}
    if end is not None:
        return {"key": _b(key), "range_end": _b(end)}
    return {"key": _b(key)}


@dataclass(frozen=True, slots=True)
class EtcdConfig:
    """How to reach etcd. ``endpoints`` are ``host:port`` (``https://`` implies TLS).

    ``request_timeout_s`` bounds one RPC; ``retry_deadline_s`` bounds all attempts of one
    idempotent operation across endpoints before :class:`EtcdUnavailable` is raised.
    """

    endpoints: tuple[str, ...]
    username: str | None = None
    password: str | None = None
    ca_cert: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    tls: bool = False
    request_timeout_s: float = 2.0
    retry_deadline_s: float = 5.0
    _targets: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        endpoints = (self.endpoints,) if isinstance(self.endpoints, str) else tuple(self.endpoints)
        if not endpoints:
            raise ValueError(f"endpoints must list at least one host:port, got {self.endpoints!r}")
        object.__setattr__(self, "endpoints", endpoints)
        targets = []
        tls = self.tls or self.ca_cert is not None or self.client_cert is not None
        for ep in endpoints:
            rest = ep
            for scheme in ("http://", "https://"):
                if rest.startswith(scheme):
                    tls = tls or scheme == "https://"
                    rest = rest[len(scheme):]
            host, sep, port = rest.rstrip("/").rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"endpoint must look like host:port, got {ep!r}")
            targets.append(f"{host}:{port}")
        object.__setattr__(self, "_targets", tuple(targets))
        object.__setattr__(self, "tls", tls)
        if (self.username is None) != (self.password is None):
            raise ValueError(
                f"username and password go together, got username={self.username!r} and "
                f"password={'<set>' if self.password else None!r}"
            )
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError(
                f"client_cert and client_key go together, got {self.client_cert!r}, "
                f"{self.client_key!r}"
            )
        if self.request_timeout_s <= 0 or self.retry_deadline_s <= 0:
            raise ValueError(
                f"timeouts must be > 0, got request_timeout_s={self.request_timeout_s}, "
                f"retry_deadline_s={self.retry_deadline_s}"
            )

    @property
    def targets(self) -> tuple[str, ...]:
        return self._targets


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One etcd key-value with its revisions."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_pb(cls, kv) -> KeyValue:
        return cls(kv.key.decode(), bytes(kv.value), kv.create_revision, kv.mod_revision,
                   kv.version, kv.lease)


@dataclass(frozen=True, slots=True)
class RangeResult:
    """Keys of one range read and the store revision the read saw."""

    kvs: tuple[KeyValue, ...]
    revision: int


@dataclass(frozen=True, slots=True)
class Compare:
    """One transaction guard: ``target`` of ``key`` ``op`` ``value``.

    target: ``version`` | ``create`` | ``mod`` | ``value`` | ``lease``; op: ``==`` ``!=``
    ``<`` ``>``. A missing key has version, create and mod revision 0.
    """

    key: str
    target: str
    op: str
    value: int | bytes | str

    _TARGETS = {"version": rpc.Compare.VERSION, "create": rpc.Compare.CREATE,
                "mod": rpc.Compare.MOD, "value": rpc.Compare.VALUE, "lease": rpc.Compare.LEASE}
    _OPS = {"==": rpc.Compare.EQUAL, "!=": rpc.Compare.NOT_EQUAL, "<": rpc.Compare.LESS,
            ">": rpc.Compare.GREATER}

    def __post_init__(self) -> None:
        if self.target not in self._TARGETS:
            raise ValueError(f"compare target must be one of {sorted(self._TARGETS)}, got {self.target!r}")
        if self.op not in self._OPS:
            raise ValueError(f"compare op must be one of {sorted(self._OPS)}, got {self.op!r}")

    def to_pb(self):
        msg = rpc.Compare(key=_b(self.key), target=self._TARGETS[self.target],
                          result=self._OPS[self.op])
        if self.target == "version":
            msg.version = int(self.value)
        elif self.target == "create":
            msg.create_revision = int(self.value)
        elif self.target == "mod":
            msg.mod_revision = int(self.value)
        elif self.target == "lease":
            msg.lease = int(self.value)
        else:
            msg.value = _b(self.value)
        return msg


@dataclass(frozen=True, slots=True)
class Put:
    key: str
    value: bytes
    lease: int = 0

    def to_pb(self):
        return rpc.RequestOp(request_put=rpc.PutRequest(key=_b(self.key), value=_b(self.value),
                                                        lease=self.lease))


@dataclass(frozen=True, slots=True)
class Get:
    key: str
    prefix: bool = False

    def to_pb(self):
        return rpc.RequestOp(request_range=rpc.RangeRequest(**_key_range(self.key, prefix=self.prefix)))


@dataclass(frozen=True, slots=True)
class Delete:
    key: str
    prefix: bool = False

    def to_pb(self):
        return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(**_key_range(self.key, prefix=self.prefix)))


@dataclass(frozen=True, slots=True)
class TxnResult:
    """Outcome of a transaction; ``gets`` holds the key-values of each ``Get`` branch op."""

    succeeded: bool
    revision: int
    gets: tuple[tuple[KeyValue, ...], ...]


class _Connection(aetcd.Client):
    """aetcd's client with TLS credentials and reconnect-friendly channel options."""

    def __init__(self, target: str, config: EtcdConfig):
        host, _, port = target.rpartition(":")
        # Fast reconnect after an etcd restart (gRPC's default backoff grows to 120 s);
        # keepalive pings notice a dead TCP peer (etcd refuses pings more often than 5 s).
        options = {
            "grpc.initial_reconnect_backoff_ms": 100,
            "grpc.min_reconnect_backoff_ms": 100,
            "grpc.max_reconnect_backoff_ms": 1000,
            "grpc.keepalive_time_ms": 5000,
            "grpc.keepalive_timeout_ms": 2000,
            "grpc.keepalive_permit_without_calls": 1,
            "grpc.http2.max_pings_without_data": 0,
            "grpc.enable_retries": 0,
        }
        super().__init__(host=host, port=int(port), username=config.username,
                         password=config.password, timeout=config.request_timeout_s,
                         options=options)
        self._config = config

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if not self._config.tls:
            await super().connect()
            return
        # aetcd only builds insecure channels: same steps, with TLS credentials.
        cfg = self._config

        def _read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as fh:
                return fh.read()

        creds = grpc.ssl_channel_credentials(_read(cfg.ca_cert), _read(cfg.client_key),
                                             _read(cfg.client_cert))
        self.channel = rpc.secure_channel(f"{self._host}:{self._port}", creds,
                                          options=self._options.items())
        try:
            if cfg.username is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                resp = await self.auth_stub.Authenticate(
                    rpc.AuthenticateRequest(name=cfg.username, password=cfg.password),
                    timeout=self._timeout)
                self.metadata = (("token", resp.token),)
        except rpc.AioRpcError as exc:
            aetcd_exc._handle_exception(exc)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = aetcd.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                      metadata=self.metadata)
        self._connected.set()


    async def reauthenticate(self) -> None:
        """A new token for this channel: etcd drops a simple token after 5 idle minutes
        (keepalives do not count) and a JWT one when it expires."""
        stub = rpc.AuthStub(self.channel)
        resp = await stub.Authenticate(rpc.AuthenticateRequest(name=self._config.username,
                                                               password=self._config.password),
                                       timeout=self._timeout)
        self.metadata = (("token", resp.token),)


# etcd's answers to a request with an expired token: worth one new token, not an error.
_TOKEN_EXPIRED = ("invalid auth token", "revision of auth store is old")


def _token_expired(exc: BaseException) -> bool:
    text = exc.details() if isinstance(exc, rpc.AioRpcError) else str(exc)
    return any(s in (text or "") for s in _TOKEN_EXPIRED)


class EtcdClient:
    """Synchronous etcd v3 client for one process (thread-safe).

    >>> client = EtcdClient(["127.0.0.1:2379"])        # doctest: +SKIP
    >>> client.put("/k", b"v"); client.get("/k").value  # doctest: +SKIP
    """

    def __init__(self, endpoints: Sequence[str] | str | EtcdConfig, *, monotonic: bool = False,
                 **options: Any):
        """``monotonic``: every key-value answer's revision is checked against the highest
        seen before (:class:`~membership.revisions.RevisionGuard`): a member's client, for
        which a store that went back is ``JobStateLost``. Off for tools and harnesses that
        use one client across an etcd they wipe on purpose."""
        self.revisions = RevisionGuard() if monotonic else None
        self.config = endpoints if isinstance(endpoints, EtcdConfig) else EtcdConfig(
            endpoints=tuple([endpoints] if isinstance(endpoints, str) else endpoints), **options)
        self._log = get_logger(component="etcd-client")
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(_quiet_grpc_poller)
        self._thread = threading.Thread(target=self._run_loop, name="etcd-client-loop",
                                        daemon=True)
        self._thread.start()
        self._endpoint_index = 0
        self._conn: _Connection | None = None
        self._retired: list[_Connection] = []  # rotated away from, not closed in time
        self._conn_lock: asyncio.Lock | None = None
        self._closed = False
        self._tasks: set[asyncio.Task] = set()
        self._keeper: Any = None  # its companion (the LeaseKeeper of its leases), made on first use
        self._keeper_lock = threading.Lock()

    # ----------------------------------------------------------------- plumbing
    def _run_loop(self) -> None:
        """The loop thread: serve until stopped, then finish every task before closing.

        Done here rather than in :meth:`close` so that no task is left pending when the loop
        closes, however long ``close`` waited: a pending task destroyed with its loop prints
        "Task was destroyed but it is pending!" and skips its ``finally`` clauses."""
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                _, stuck = loop.run_until_complete(asyncio.wait(pending, timeout=5.0))
                if stuck:
                    self._log.warning("membership.client.tasks_stuck_at_close",
                                      tasks=sorted(t.get_name() for t in stuck))
                    self._stuck = stuck  # kept referenced: destroying them would hide the report
            # Channels retired or opened while close() ran: closed here, after the last task.
            loose = [c for c in (*self._retired, self._conn) if c is not None]
            self._conn, self._retired = None, []
            for conn in loose:
                with contextlib.suppress(Exception):
                    loop.run_until_complete(asyncio.wait_for(conn.close(), 2.0))
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def endpoint(self) -> str:
        """The endpoint currently in use."""
        return self.config.targets[self._endpoint_index]

    def run(self, coro: Awaitable[T], timeout_s: float | None = None) -> T:
        """Run a coroutine on the client loop and wait for its result (not from the loop)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("EtcdClient.run called from its own loop thread (would deadlock)")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        try:
            return fut.result(timeout_s)
        except TimeoutError:
            fut.cancel()
            raise
        finally:
            # A fault raised here holds this frame, which holds the future, which holds the
            # fault: a cycle (with the caller's handled fault as its __context__) only gc frees.
            fut = None

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Future:
        """Start a background task on the client loop; it is cancelled by :meth:`close`."""

        async def _start() -> asyncio.Task:
            return self.spawn_here(coro, name)

        return asyncio.run_coroutine_threadsafe(_start(), self._loop).result(5)

    def spawn_here(self, coro: Awaitable[Any], name: str) -> asyncio.Task:
        """:meth:`spawn` from the loop thread itself (``spawn`` waits for the loop, so it
        would deadlock there)."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def companion(self, make: Callable[[EtcdConfig], T]) -> T:
        """The one object ``make(self.config)`` of this client (made on first use), closed
        first when the client closes: e.g. the ``LeaseKeeper`` of its members' leases
        (``membership.leases.lease_keeper``), which runs on a thread and channel of its own."""
        with self._keeper_lock:
            if self._closed:
                raise RuntimeError("EtcdClient is closed")
            if self._keeper is None:
                self._keeper = make(self.config)
            return self._keeper

    async def connection(self) -> _Connection:
        if self._conn_lock is None:
            self._conn_lock = asyncio.Lock()
        async with self._conn_lock:
            if self._closed:  # a retry racing close() would open a channel nobody closes
                raise EtcdUnavailable(self.config.targets, "connect", RuntimeError("the client is closed"))
            if self._conn is None:
                self._conn = _Connection(self.endpoint, self.config)
            await asyncio.wait_for(self._conn.connect(), self.config.request_timeout_s)
            return self._conn

    async def _rotate(self, failed: _Connection | None) -> None:
        """Drop a failed channel and move to the next endpoint (round robin)."""
        if self._conn_lock is None:
            self._conn_lock = asyncio.Lock()
        async with self._conn_lock:
            if failed is not None and self._conn is not failed:
                return  # someone else already rotated
            old, self._conn = self._conn, None
            if len(self.config.targets) > 1:
                self._endpoint_index = (self._endpoint_index + 1) % len(self.config.targets)
        if old is not None:
            try:
                await asyncio.wait_for(old.close(), 1.0)
            except Exception:  # (a stalled endpoint) closed again at shutdown: never a leaked socket
                self._retired.append(old)  # the loop thread's last sweep closes it if shutdown ran

    def _rotates_on(self, exc: BaseException | None) -> bool:
        """Whether ``exc`` is worth a new channel. With several endpoints a slow or failed
        one is left for the next. With one, only a failed connection is: a request past
        its deadline means a loaded etcd, and closing the channel would fail every watch
        and request in flight on it (under load, a collapse: each failure closed it again)."""
        if len(self.config.targets) > 1:
            return isinstance(exc, aetcd_exc.ConnectionFailedError | aetcd_exc.ConnectionTimeoutError
                              | asyncio.TimeoutError)
        return isinstance(exc, aetcd_exc.ConnectionFailedError)

    async def call(self, op: str, fn: Callable[[_Connection], Awaitable[T]], *,
                   idempotent: bool = True, deadline_s: float | None = None) -> T:
        """Run ``fn(connection)`` with retries; raise :class:`EtcdUnavailable` when spent.

        Non-idempotent operations (transactions) get one attempt: a retry after a lost
        reply could apply twice or report a false failure.
        """
        deadline = self.config.retry_deadline_s if deadline_s is None else deadline_s
        current: dict[str, _Connection | None] = {"conn": None}

        async def attempt() -> T:
            try:
                conn = await self.connection()  # authenticates, when there are credentials
                current["conn"] = conn
                try:
                    return await fn(conn)
                except (rpc.AioRpcError, aetcd_exc.ClientError) as exc:
                    if self.config.username is None or not _token_expired(exc):
                        raise
                    # The request was refused before it was applied (auth comes first), so
                    # even a transaction is safe to send again with a new token.
                    await conn.reauthenticate()
                    self._log.info("membership.etcd.reauthenticated", op=op, endpoint=self.endpoint)
                    return await fn(conn)
            except rpc.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED) or any(
                        s in (exc.details() or "") for s in _ACCESS_DENIED):
                    raise EtcdAccessDenied(self.config.targets, op, exc.details() or exc.code().name) from exc
                aetcd_exc._handle_exception(exc)
                raise  # unreachable: _handle_exception always raises
            except aetcd_exc.ClientError as exc:
                if isinstance(exc, aetcd_exc.UnauthenticatedError) or any(
                        s in str(exc) for s in _ACCESS_DENIED):
                    raise EtcdAccessDenied(self.config.targets, op, str(exc) or "authentication failed") from exc
                raise
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise
                # grpc.aio cancels the RPCs of a channel another task closed while
                # rotating endpoints: a transient fault, retried on the new channel.
                raise aetcd_exc.ConnectionFailedError("channel closed during the call") from None

        async def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            self._log.debug("membership.etcd.retry", op=op, endpoint=self.endpoint,
                            attempt=state.attempt_number, error=repr(exc))
            if self._rotates_on(exc):
                await self._rotate(current["conn"])

        if not idempotent:
            try:
                return await attempt()
            except _TRANSIENT as exc:
                if self._rotates_on(exc):
                    await self._rotate(current["conn"])
                raise EtcdUnavailable(self.config.targets, op, exc) from exc
        try:
            async for trial in AsyncRetrying(
                stop=stop_after_delay(deadline),
                wait=wait_exponential(multiplier=0.05, min=0.05, max=0.5),
                retry=retry_if_exception_type(_TRANSIENT),
                before_sleep=before_sleep,
                reraise=True,
            ):
                with trial:
                    return await attempt()
        except _TRANSIENT as exc:
            raise EtcdUnavailable(self.config.targets, op, exc) from exc
        raise AssertionError("unreachable")

    def _sync(self, coro: Awaitable[T]) -> T:
        # The loop-side deadline raises first; this outer bound only guards a wedged loop.
        return self.run(coro, timeout_s=self.config.retry_deadline_s
                        + 2 * self.config.request_timeout_s + 5.0)

    async def _kv(self, conn: _Connection, method: Callable[..., Awaitable[Any]], request: Any) -> Any:
        """One key-value RPC; a monotonic client (see ``__init__``) checks its answer's
        revision against the highest one answered before the request was sent: only
        requests ordered in real time are ordered in revisions (two in flight at once may
        be answered in either order)."""
        if self.revisions is None:
            return await method(request, **self._md(conn))
        floor = self.revisions.highest
        resp = await method(request, **self._md(conn))
        self.revisions.saw(int(resp.header.revision), self.endpoint, floor=floor)
        return resp

    def _md(self, conn: _Connection) -> dict[str, Any]:
        return {"timeout": self.config.request_timeout_s, "metadata": conn.metadata}

    # ---------------------------------------------------------------- async API
    async def aget(self, key: str) -> KeyValue | None:
        async def fn(c: _Connection):
            resp = await self._kv(c, c.kvstub.Range, rpc.RangeRequest(key=_b(key)))
            return KeyValue.from_pb(resp.kvs[0]) if resp.kvs else None

        return await self.call(f"get {key}", fn)

    async def arange(self, start: str, end: str | None = None, *, prefix: bool = False,
                     count_only: bool = False) -> RangeResult | int:
        async def fn(c: _Connection):
            req = rpc.RangeRequest(**_key_range(start, prefix=prefix, end=end), count_only=count_only)
            resp = await self._kv(c, c.kvstub.Range, req)
            if count_only:
                return int(resp.count)
            return RangeResult(tuple(KeyValue.from_pb(kv) for kv in resp.kvs),
                               resp.header.revision)

        return await self.call(f"range {start}", fn)

    async def afirst(self, start: str, end: str) -> KeyValue | None:
        async def fn(c: _Connection):
            resp = await self._kv(c, c.kvstub.Range, rpc.RangeRequest(**_key_range(start, end=end), limit=1))
            return KeyValue.from_pb(resp.kvs[0]) if resp.kvs else None

        return await self.call(f"range {start}", fn)

    async def aput(self, key: str, value: bytes | str, lease: int = 0) -> int:
        async def fn(c: _Connection):
            resp = await self._kv(c, c.kvstub.Put, rpc.PutRequest(key=_b(key), value=_b(value), lease=lease))
            return resp.header.revision

        return await self.call(f"put {key}", fn)

    async def adelete(self, key: str, *, prefix: bool = False) -> int:
        async def fn(c: _Connection):
            req = rpc.DeleteRangeRequest(**_key_range(key, prefix=prefix))
            resp = await self._kv(c, c.kvstub.DeleteRange, req)
            return int(resp.deleted)

        return await self.call(f"delete {key}", fn)

    async def atxn(self, compare: Sequence[Compare], success: Sequence[Put | Get | Delete],
                   failure: Sequence[Put | Get | Delete] = (), *, idempotent: bool = False) -> TxnResult:
        """``idempotent``: applying the transaction twice has the effect and the outcome of
        applying it once (e.g. a put guarded only by our own lease), so it may be retried."""

        async def fn(c: _Connection):
            req = rpc.TxnRequest(compare=[x.to_pb() for x in compare],
                                 success=[x.to_pb() for x in success],
                                 failure=[x.to_pb() for x in failure])
            resp = await self._kv(c, c.kvstub.Txn, req)
            gets = tuple(
                tuple(KeyValue.from_pb(kv) for kv in r.response_range.kvs)
                for r in resp.responses if r.WhichOneof("response") == "response_range"
            )
            return TxnResult(bool(resp.succeeded), resp.header.revision, gets)

        keys = ",".join(sorted({x.key for x in compare}))
        return await self.call(f"txn {keys}", fn, idempotent=idempotent)

    async def agrant_lease(self, ttl_s: int) -> tuple[int, int]:
        """Grant a lease; returns ``(lease_id, granted_ttl_s)``."""

        async def fn(c: _Connection):
            resp = await c.leasestub.LeaseGrant(rpc.LeaseGrantRequest(TTL=int(ttl_s)),
                                                **self._md(c))
            if resp.error:
                raise aetcd_exc.ClientError(resp.error)
            return int(resp.ID), int(resp.TTL)

        return await self.call("lease grant", fn)

    async def arevoke_lease(self, lease_id: int) -> bool:
        """Revoke a lease (its keys vanish); ``False`` if it had already expired."""

        async def fn(c: _Connection):
            try:
                await c.leasestub.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease_id), **self._md(c))
                return True
            except rpc.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return False
                raise

        return await self.call("lease revoke", fn)

    async def alease_ttl(self, lease_id: int) -> int:
        """Remaining TTL of a lease in seconds, ``-1`` when it does not exist."""

        async def fn(c: _Connection):
            resp = await c.leasestub.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease_id),
                                                     **self._md(c))
            return int(resp.TTL)

        return await self.call("lease ttl", fn)

    async def aleases(self) -> list[int]:
        async def fn(c: _Connection):
            resp = await c.leasestub.LeaseLeases(rpc.LeaseLeasesRequest(), **self._md(c))
            return [int(x.ID) for x in resp.leases]

        return await self.call("lease list", fn)

    async def adb_size(self) -> int:
        async def fn(c: _Connection):
            resp = await c.maintenancestub.Status(rpc.StatusRequest(), **self._md(c))
            return int(resp.dbSize)

        return await self.call("status", fn)

    async def acompact(self, revision: int) -> None:
        async def fn(c: _Connection):
            await c.kvstub.Compact(rpc.CompactionRequest(revision=revision, physical=True),
                                   **self._md(c))

        await self.call("compact", fn)

    async def arevision(self) -> int:
        """The current store revision (a cheap read of one missing key)."""

        async def fn(c: _Connection):
            resp = await self._kv(c, c.kvstub.Range, rpc.RangeRequest(key=b"\0", count_only=True))
            return int(resp.header.revision)

        return await self.call("revision", fn)

    # ----------------------------------------------------------------- sync API
    def get(self, key: str) -> KeyValue | None:
        """The key-value at ``key`` or ``None``."""
        return self._sync(self.aget(key))

    def get_prefix(self, prefix: str) -> RangeResult:
        """All keys under ``prefix`` (sorted by key) and the revision of the read."""
        return self._sync(self.arange(prefix, prefix=True))  # type: ignore[return-value]

    def get_range(self, start: str, end: str) -> RangeResult:
        """All keys in ``[start, end)`` and the revision of the read."""
        return self._sync(self.arange(start, end))  # type: ignore[return-value]

    def first(self, start: str, end: str) -> KeyValue | None:
        """The first key-value in ``[start, end)`` (one range read of one key), or ``None``."""
        return self._sync(self.afirst(start, end))  # type: ignore[return-value]

    def count_prefix(self, prefix: str) -> int:
        """Number of keys under ``prefix``."""
        return self._sync(self.arange(prefix, prefix=True, count_only=True))  # type: ignore[return-value]

    def put(self, key: str, value: bytes | str, lease: int = 0) -> int:
        """Write ``key``; returns the new store revision."""
        return self._sync(self.aput(key, value, lease))

    def delete(self, key: str) -> bool:
        """Delete one key; ``True`` if it existed."""
        return self._sync(self.adelete(key)) > 0

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix``; returns how many were deleted."""
        return self._sync(self.adelete(prefix, prefix=True))

    def txn(self, compare: Sequence[Compare], success: Sequence[Put | Get | Delete],
            failure: Sequence[Put | Get | Delete] = (), *, idempotent: bool = False) -> TxnResult:
        """An etcd transaction (one attempt unless ``idempotent``: see :meth:`call`)."""
        return self._sync(self.atxn(compare, success, failure, idempotent=idempotent))

    def grant_lease(self, ttl_s: int) -> tuple[int, int]:
        """Grant a lease of ``ttl_s`` seconds; returns ``(lease_id, granted_ttl_s)``."""
        return self._sync(self.agrant_lease(ttl_s))

    def revoke_lease(self, lease_id: int) -> bool:
        """Revoke a lease; ``False`` if it was already gone."""
        return self._sync(self.arevoke_lease(lease_id))

    def lease_ttl(self, lease_id: int) -> int:
        """Remaining TTL, -1 if the lease does not exist."""
        return self._sync(self.alease_ttl(lease_id))

    def leases(self) -> list[int]:
        """IDs of every live lease on the cluster."""
        return self._sync(self.aleases())

    def db_size(self) -> int:
        """Bytes of the backend database of the member this client talks to."""
        return self._sync(self.adb_size())

    def compact(self, revision: int) -> None:
        """Compact history up to ``revision`` (watches older than it must relist)."""
        self._sync(self.acompact(revision))

    def revision(self) -> int:
        """The current store revision."""
        return self._sync(self.arevision())

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Cancel background tasks, close the channel and stop the loop thread."""
        with self._keeper_lock:
            if self._closed:
                return
            self._closed = True
            keeper, self._keeper = self._keeper, None
        if keeper is not None:  # first: a closed client's leases are no longer renewed
            keeper.close()

        async def _shutdown() -> None:
            tasks = [t for t in self._tasks if not t.done()]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=2.0)
            for conn in [*self._retired, self._conn]:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(conn.close(), 1.0)
            self._conn, self._retired = None, []

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_shutdown(), self._loop).result(5.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        # The loop thread finishes the remaining tasks and closes the loop itself.
        self._thread.join(timeout=10.0)

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
