"""The nccl4py transport: NCCL communicators this runtime owns directly.

Compared with torch's ProcessGroupNCCL, owning the communicator gives the runtime NCCL's
whole lifecycle: non-blocking initialisation that can be aborted, ``revoke`` to quiesce
in-flight work (NCCL >= 2.28.7), ``shrink`` (>= 2.27) and ``grow`` (>= 2.29.2). The
lifecycle is driven by ``membership.comm`` through the transport factory
(``elastic_refit.transport.factory``); this module holds its NCCL calls (init, parent state,
shrink, grow, each settled by polling) and moves bytes.

Every batch of operations is posted inside one NCCL group on the transport's own CUDA
stream, ordered after the work already queued on the caller's stream (a CUDA event, no
device-wide synchronisation), and completes when an event recorded after it fires. Waits
poll that event and the communicator's asynchronous error state, so a dead peer or a
timeout ends in ``TransportAborted`` instead of a hang. nccl4py is optional (the
``[nccl]`` extra); nothing imports it on CPU machines.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from elastic_refit.errors import TransportAborted
from elastic_refit.transport.protocol import (
    Backend,
    Capabilities,
    P2POp,
    TransportBase,
    abort_with_watchdog,
    first_line,
)

__all__ = ["GROW_ID_KEY", "MAX_CTAS_ENV", "POLL_MAX_ENV", "Nccl4pySupport", "NcclTransport", "grow_communicator",
           "init_communicator", "max_ctas", "nccl_call", "nccl_config", "parent_state", "poll_delay", "poll_max_s",
           "probe_nccl4py", "quiesce", "settle", "settle_child", "shrink_communicator"]

_POLL_S = 0.0005
# A transfer's wait polls every _POLL_S at first, then every twentieth of what it has waited,
# up to ELASTIC_REFIT_NCCL_POLL_MAX_S (default 2 ms): a long wait (bytes trickling in over
# sockets) wakes its thread, and takes the GIL from the engine's generation beside it, a few
# hundred times a second instead of two thousand, and notices its event at most 5% (or the
# cap) late. The cap at _POLL_S is the constant poll of before.
POLL_MAX_ENV = "ELASTIC_REFIT_NCCL_POLL_MAX_S"
_POLL_FRACTION = 0.05
_CANCEL_CHECK_S = 0.02  # cancel() may read shared state; the poll itself stays tight


log = structlog.get_logger("elastic_refit.transport")  # lazy: follows the current configuration


def _nccl():
    import nccl.core as nccl_core  # optional: the [nccl] extra

    return nccl_core


def _in_progress_code() -> int:
    from nccl.bindings import nccl as bindings

    return int(bindings.Result.InProgress)


@dataclass(frozen=True, slots=True)
class Nccl4pySupport:
    """What the installed nccl4py offers: its version, the libnccl it loaded, and whether
    its communicators can shrink and grow (all empty when nccl4py is absent)."""

    version: str | None = None
    nccl_version: tuple[int, int, int] | None = None
    shrink: bool = False
    grow: bool = False


def probe_nccl4py() -> Nccl4pySupport:
    """Probe nccl4py (cheap, side-effect free, never raises): what it reported before a
    failure (no CUDA runtime, say) is kept."""
    found: dict[str, Any] = {}
    try:
        import nccl.core as nccl_core  # nccl4py

        comm_cls = getattr(nccl_core, "Communicator", None)
        found["version"] = str(getattr(nccl_core, "__version__", None)
                               or getattr(__import__("nccl"), "__version__", "unknown"))
        found["shrink"] = comm_cls is not None and hasattr(comm_cls, "shrink")
        found["grow"] = comm_cls is not None and hasattr(comm_cls, "grow")
        lib = nccl_core.get_version().libnccl
        if lib is not None:
            release = lib.version.release
            found["nccl_version"] = (int(release[0]), int(release[1]), int(release[2]) if len(release) > 2 else 0)
    except Exception:  # absent, or present without a CUDA runtime
        pass
    return Nccl4pySupport(**found)


def nccl_call(fn: Callable[[], Any]) -> Any:
    """Run one nccl4py call; a non-blocking communicator may answer ``ncclInProgress``,
    which is not an error (:func:`settle` waits for it)."""
    try:
        return fn()
    except Exception as exc:
        status = getattr(exc, "status", None)
        if status is not None and int(status) == _in_progress_code():
            return None
        raise


class _Bound:
    """The bound of one polled wait: ``check()`` raises ``TransportAborted`` past the
    deadline, or once ``cancel()`` (asked every ``_CANCEL_CHECK_S`` at most) says the wait is
    futile (a newer epoch exists: a peer that never arrives will not)."""

    def __init__(self, timeout_s: float, what: str, cancel: Callable[[], bool] | None) -> None:
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.what = what
        self.cancel = cancel
        self.asked = time.monotonic()

    def check(self, pending: str) -> None:
        now = time.monotonic()
        if now > self.deadline:
            raise TransportAborted(f"{self.what}: {pending} within {self.timeout_s} s", phase=self.what)
        if self.cancel is not None and now - self.asked > _CANCEL_CHECK_S:
            self.asked = now
            if self.cancel():
                raise TransportAborted(f"{self.what}: given up, superseded", phase=self.what)

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


def settle(comm: Any, timeout_s: float, what: str, cancel: Callable[[], bool] | None = None) -> None:
    """Wait until ``comm`` (non-blocking) is no longer ``ncclInProgress``; raise
    ``TransportAborted`` on an error state, on the timeout, or as soon as ``cancel()`` says
    the wait is futile (see :class:`_Bound`)."""
    in_progress = _in_progress_code()
    bound = _Bound(timeout_s, what, cancel)
    while True:
        state = int(comm.get_async_error())
        if state == 0:
            return
        if state != in_progress:
            raise TransportAborted(f"{what}: NCCL reports error {state}: {_error_string(state)}", phase=what)
        bound.check("not done")
        time.sleep(_POLL_S)


def quiesce(comm: Any, timeout_s: float) -> int:
    """Wait (at most ``timeout_s``) while ``comm`` is ``ncclInProgress``, e.g. after a
    revoke; return its state then (0, an error code, or still in progress). Never raises on
    an error state: the caller decides (an abortive shrink accepts one)."""
    in_progress = _in_progress_code()
    deadline = time.monotonic() + timeout_s
    state = in_progress
    with contextlib.suppress(Exception):
        while (state := int(comm.get_async_error())) == in_progress and time.monotonic() < deadline:
            time.sleep(_POLL_S)
    return state


def settle_child(parent: Any, child: Any, timeout_s: float, what: str,
                 cancel: Callable[[], bool] | None = None) -> None:
    """Wait for a communicator that ``parent.shrink`` or ``parent.grow`` returned (``parent``
    None for a newcomer's grow). On a non-blocking parent NCCL fills the child's handle only
    when the job completes: until then the child is null and has no state of its own, so
    this polls for the handle (querying the parent, which completes its group job), then
    settles the child. Raises ``TransportAborted`` on the timeout, an error state, or once
    ``cancel()`` is true (see :func:`settle`)."""
    bound = _Bound(timeout_s, what, cancel)
    while not child.is_valid:
        if parent is not None:
            with contextlib.suppress(Exception):  # its own state may be an error (a dead peer)
                parent.get_async_error()
        bound.check("no communicator")
        time.sleep(_POLL_S)
    settle(child, bound.left(), what, cancel)


def _error_string(state: int) -> str:
    with contextlib.suppress(Exception):
        return str(_nccl().get_error_string(state))
    return "unknown"


def init_communicator(store: Any, rank: int, world_size: int, timeout_s: float,
                      cancel: Callable[[], bool] | None = None) -> Any:
    """A non-blocking nccl4py communicator of ``world_size`` ranks, settled: rank 0 publishes
    the unique id in ``store`` (any ``torch.distributed.Store``, e.g. an epoch's etcd store).
    ``cancel`` (see :func:`settle`) gives up early; a half-made communicator is aborted."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    nccl = _nccl()
    if rank == 0:
        store.set("nccl4py/unique_id", nccl.get_unique_id().as_bytes)
    uid = nccl.UniqueId.from_bytes(store.get("nccl4py/unique_id"))
    comm = nccl.Communicator()
    nccl_call(lambda: comm.initialize(world_size, rank, uid, nccl_config()))
    try:
        settle(comm, timeout_s, "nccl4py init", cancel)
    except BaseException:
        abort_with_watchdog(comm, timeout_s, log, "init")  # else its bootstrap sockets outlive the failed init
        raise
    return comm


# Where the grow root puts the unique id the newcomers join with (a key of the epoch's store).
GROW_ID_KEY = "grow_unique_id"


def parent_state(comm: Any, timeout_s: float) -> int:
    """Whether ``comm`` can be shrunk or grown from: its NCCL state once it is no longer
    ``ncclInProgress`` (0: ready). An error state (a peer died under a transfer) is final
    here: a revoke does not clear ncclRemoteError (NCCL 2.28.9 and 2.32.3, measured: 57 of
    57 revokes in a chaos run left state 6) and costs about 0.5 s, so the caller rebuilds
    instead. Never raises."""
    return quiesce(comm, timeout_s)


def shrink_communicator(parent: Any, excluded: Sequence[int], *, abort: bool, timeout_s: float,
                        abort_timeout_s: float, cancel: Callable[[], bool] | None = None,
                        logger: Any = None) -> Any:
    """The child of ``parent`` without the ranks ``excluded``, settled (see
    :func:`settle_child`). ``abort``: a peer died, so in-flight work on the parent is aborted
    (``CommShrinkFlag.ABORT``); otherwise the leavers are alive and this rank's own work in
    flight is revoked first. A child that never settles is aborted (bounded by
    ``abort_timeout_s``, reported on ``logger``) before the error propagates. The parent is
    the caller's to abort afterwards."""
    nccl = _nccl()
    if not abort:
        # Leavers are alive: quiesce whatever this rank still has in flight first.
        with contextlib.suppress(Exception):
            nccl_call(parent.revoke)
    # No NCCL call may follow one still in progress (a revoke from the transport's abort,
    # say); an error state is what an abortive shrink is for.
    quiesce(parent, abort_timeout_s)
    flag = nccl.CommShrinkFlag.ABORT if abort else nccl.CommShrinkFlag.DEFAULT
    child = nccl_call(lambda: parent.shrink(excluded, config=nccl_config(), flag=flag))
    with _aborted_on_failure(child, abort_timeout_s, logger, "shrink_child"):
        settle_child(parent, child, timeout_s, "nccl4py shrink", cancel)
    return child


def grow_communicator(parent: Any | None, num_ranks: int, rank: int, store: Any, *, timeout_s: float,
                      abort_timeout_s: float, cancel: Callable[[], bool] | None = None,
                      logger: Any = None) -> Any:
    """A communicator of ``num_ranks`` grown from ``parent``, settled (see
    :func:`settle_child`). Existing ranks pass their communicator and keep their numbers;
    the grow root (rank 0, an existing rank) publishes the grow id in ``store``
    (:data:`GROW_ID_KEY`), and a newcomer (``parent`` None, on its CUDA device already)
    reads it there. A child that never settles is aborted as in
    :func:`shrink_communicator`; the parent is the caller's to abort."""
    nccl = _nccl()
    config = nccl_config()
    if parent is not None and rank == 0:
        uid = parent.get_unique_id()
        store.set(GROW_ID_KEY, uid.as_bytes)
        child = nccl_call(lambda: parent.grow(num_ranks, uid, config=config))
    elif parent is not None:
        child = nccl_call(lambda: parent.grow(num_ranks, config=config))
    else:
        uid = nccl.UniqueId.from_bytes(store.get(GROW_ID_KEY))
        child = nccl_call(lambda: nccl.Communicator().grow(num_ranks, uid, rank=rank, config=config))
    with _aborted_on_failure(child, abort_timeout_s, logger, "grow_child"):
        settle_child(parent, child, timeout_s, "nccl4py grow", cancel)
    return child


@contextlib.contextmanager
def _aborted_on_failure(child: Any, timeout_s: float, logger: Any, what: str):
    """A shrunk or grown child that never settled (a peer died meanwhile) still holds
    NCCL's bootstrap sockets and proxy thread: abort it (bounded) before the error goes
    on to the caller's fallback, which otherwise leaks them for the life of the process."""
    try:
        yield
    except BaseException:
        if getattr(child, "is_valid", False):
            abort_with_watchdog(child, timeout_s, logger if logger is not None else log, what)
        raise


MAX_CTAS_ENV = "ELASTIC_REFIT_NCCL_MAX_CTAS"


def max_ctas(environ: Mapping[str, str]) -> int | None:
    """The CTA cap of this runtime's communicators from ``environ`` (``MAX_CTAS_ENV``;
    unset or empty: NCCL's default). Where the refit shares a GPU with generation (a
    colocated engine, or ranks under MPS), fewer CTAs leave it more SMs while a transfer's
    kernels wait for their bytes. Only these communicators: ``NCCL_MAX_CTAS`` would cap
    the trainers' own collectives too."""
    text = environ.get(MAX_CTAS_ENV, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 32:  # NCCL's range for a communicator's CTAs
        raise ValueError(f"{MAX_CTAS_ENV} must be an int from 1 to 32 (CTAs per NCCL kernel), got {text!r}")
    return value


def poll_max_s(environ: Mapping[str, str]) -> float:
    """The longest a transfer's wait sleeps between polls, from ``environ`` (``POLL_MAX_ENV``,
    seconds, 0.0005-0.05; unset or empty: 0.002)."""
    text = environ.get(POLL_MAX_ENV, "").strip()
    if not text:
        return 0.002
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not _POLL_S <= value <= 0.05:
        raise ValueError(f"{POLL_MAX_ENV} must be seconds from {_POLL_S} to 0.05, got {text!r}")
    return value


def poll_delay(waited_s: float, max_s: float) -> float:
    """How long a wait that has lasted ``waited_s`` sleeps before it polls again (pure)."""
    return min(max_s, max(_POLL_S, waited_s * _POLL_FRACTION))


def nccl_config() -> Any:
    """Non-blocking: init, shrink and grow return at once and are settled by polling, so a
    peer that dies mid-way ends in a timeout or an error, never a hang. Capped at
    :func:`max_ctas` CTAs when the environment says so."""
    cap = max_ctas(os.environ)
    return _nccl().NCCLConfig(blocking=False, **({} if cap is None else {"min_ctas": 1, "max_ctas": cap}))


class _Posted:
    """The completion event of one batch; keeps its tensors alive until then."""

    __slots__ = ("event", "tensors")

    def __init__(self, event: torch.cuda.Event, tensors: list[torch.Tensor]) -> None:
        self.event = event
        self.tensors = tensors

    def wait(self, timeout: object = None) -> bool:
        return self.event.query()


class NcclTransport(TransportBase):
    """A :class:`~elastic_refit.transport.protocol.Transport` over one nccl4py communicator.

    ``comm`` must be initialised (and settled); ``timeout_s`` bounds every wait and vote.
    Tags are not used: NCCL matches the operations of a pair in posting order, which the
    executor and baseline keep identical on both sides.
    """

    def __init__(self, comm: Any, rank: int, world_size: int, *, timeout_s: float = 30.0,
                 device: torch.device | None = None, can_shrink: bool = False, can_grow: bool = False) -> None:
        device = device or torch.device("cuda", torch.cuda.current_device())
        super().__init__(rank, world_size, Capabilities(Backend.NCCL4PY, device, can_shrink=can_shrink,
                                                        can_grow=can_grow), timeout_s)
        self.comm = comm
        self.stream = torch.cuda.Stream(device=device)
        self._poll_max_s = poll_max_s(os.environ)

    @classmethod
    def create(cls, store: Any, rank: int, world_size: int, *, timeout_s: float = 30.0,
               init_timeout_s: float = 60.0) -> NcclTransport:
        """Initialise a communicator over ``store`` on the current CUDA device (see
        :func:`init_communicator`) and wrap it; every rank calls this."""
        return cls(init_communicator(store, rank, world_size, init_timeout_s), rank, world_size,
                   timeout_s=timeout_s)

    # ---- the protocol ------------------------------------------------------------------
    def post(self, ops: Sequence[P2POp]) -> tuple[_Posted, ...]:
        if self._aborted:
            raise TransportAborted(f"rank {self.rank}: post on an aborted transport", rank=self.rank)
        nccl = _nccl()
        # What the caller queued (packing, copies) runs before the communication.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            nccl_call(nccl.group_start)
            try:
                for op in ops:
                    if op.op == "send":
                        nccl_call(lambda op=op: self.comm.send(op.tensor, op.peer, stream=self.stream))
                    else:
                        nccl_call(lambda op=op: self.comm.recv(op.tensor, op.peer, stream=self.stream))
            finally:
                nccl_call(nccl.group_end)
            # A non-blocking communicator may still be enqueueing the group: nothing is on
            # the stream (and no other call is allowed) until its state is ncclSuccess.
            settle(self.comm, self.timeout_s, f"rank {self.rank}: posting a group")
        except TransportAborted:
            raise
        except Exception as exc:
            peers = sorted({op.peer for op in ops})
            raise TransportAborted(f"rank {self.rank}: posting to ranks {peers} failed: {first_line(exc)}",
                                   rank=self.rank, peer=peers[0] if peers else None, phase="post") from exc
        event = torch.cuda.Event()
        event.record(self.stream)
        for op in ops:  # the caching allocator must not reuse these before NCCL is done
            op.tensor.record_stream(self.stream)
        posted = _Posted(event, [op.tensor for op in ops])
        return (posted,) * len(ops)  # NCCL completes a group as a whole

    def wait(self, work: _Posted, peer: int, what: str) -> None:
        started = time.monotonic()
        deadline = started + self.timeout_s
        in_progress = _in_progress_code()
        while not work.event.query():
            if self._aborted:  # by this rank's fault handling, or an epoch that dropped a peer
                raise TransportAborted(f"rank {self.rank}: {what} with rank {peer} stopped: the transport was "
                                       "aborted", rank=self.rank, phase=what)
            state = int(self.comm.get_async_error())
            if state not in (0, in_progress):
                self.abort()
                raise TransportAborted(
                    f"rank {self.rank}: {what} with rank {peer} failed: NCCL error {state}: {_error_string(state)}",
                    rank=self.rank, peer=peer, phase=what)
            if time.monotonic() > deadline:
                self.abort()
                raise TransportAborted(f"rank {self.rank}: {what} with rank {peer} not done within "
                                       f"{self.timeout_s} s", rank=self.rank, peer=peer, phase=what)
            time.sleep(poll_delay(time.monotonic() - started, self._poll_max_s))
        # Later work on the caller's stream (unpacking) sees the received bytes.
        torch.cuda.current_stream(self.device).wait_event(work.event)

    def _allreduce_flag(self, flag: torch.Tensor) -> None:
        nccl = _nccl()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        nccl_call(lambda: self.comm.allreduce(flag, flag, nccl.SUM, stream=self.stream))
        settle(self.comm, self.timeout_s, f"rank {self.rank}: posting the vote")
        event = torch.cuda.Event()
        event.record(self.stream)
        self.wait(_Posted(event, [flag]), -1, "completion vote")

    def abort(self) -> None:
        """Mark the transport aborted. The communicator itself is left to its owner
        (``membership.comm``): an abortive shrink stops its in-flight work (NCCL sets the
        abort flags and drains the device stream), and a rebuild aborts it. A revoke here
        would leave it ``ncclInProgress`` at the very moment the next epoch shrinks it."""
        self._aborted = True

    def close(self) -> None:
        self._aborted = True
        self.comm = None
