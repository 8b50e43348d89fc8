"""Typed runtime faults: one hierarchy under :class:`RefitError`.

``except RefitError`` catches every runtime fault: the ones defined here and every fault of
the membership layer (``elastic_refit.membership.errors``: ``EtcdUnavailable``,
``FencedWrite``, ``StoreTimeout``, ``CommunicatorError``, ... derive from
``MembershipError``, a ``RefitError``). Bad user input raises ``ValueError`` instead.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import NoReturn, TypeVar

E = TypeVar("E", bound=BaseException)

_SUSPENDABLE = (inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
                | inspect.CO_ITERABLE_COROUTINE)


class RefitError(RuntimeError):
    """Base class of runtime faults during a refit."""


class MembershipLost(RefitError):
    """This member's lease expired or its key was replaced: it is no longer a member.

    The runtime must stop writing and may re-join with a new incarnation.
    """


class RefitFailed(RefitError):
    """``version`` failed ``num_attempts`` consecutive attempts for the same ``cause``
    (``"Type: first line"`` of the fault) and was given up: it never commits. With
    ``num_attempts`` 0 a trainer refused it: its input was bad (``publish`` raised
    ``ValueError`` there) or changed while the version was in flight
    (:class:`SourceChanged`), so no attempt could ever succeed.

    Raised to every member that waits for that version (``publish``, ``wait_for_version``);
    later versions can still be published and commit.
    """

    def __init__(self, version: int, cause: str, num_attempts: int, *, epoch: int | None = None) -> None:
        # No attempt at all: a trainer refused its own input for the version in publish.
        how = f"failed {num_attempts} consecutive attempts" if num_attempts else "was refused"
        super().__init__(f"version {version} {how}: {cause}")
        self.version = version
        self.cause = cause
        self.num_attempts = num_attempts
        self.epoch = epoch

    def __reduce__(self):  # picklable across processes, keyword included
        return _rebuild_refit_failed, (self.version, self.cause, self.num_attempts, self.epoch)


def _rebuild_refit_failed(version: int, cause: str, num_attempts: int, epoch: int | None) -> RefitFailed:
    return RefitFailed(version, cause, num_attempts, epoch=epoch)


class RefitTimeout(RefitError, TimeoutError):
    """A ``publish`` / ``wait_for_version`` / ``weights`` deadline passed: ``what`` did not
    happen within ``timeout_s``; ``last_failure`` is this rank's latest fault, if any."""

    def __init__(self, what: str, timeout_s: float, *, member_id: str | None = None,
                 last_failure: str | None = None) -> None:
        who = f"{member_id}: " if member_id else ""
        detail = f"; last failure: {last_failure}" if last_failure else "; no attempt failed on this rank"
        super().__init__(f"{who}timed out after {timeout_s} s waiting for {what}{detail}")
        self.what = what
        self.timeout_s = timeout_s
        self.member_id = member_id
        self.last_failure = last_failure

    def __reduce__(self):
        return _rebuild_refit_timeout, (self.what, self.timeout_s, self.member_id, self.last_failure)


def _rebuild_refit_timeout(what: str, timeout_s: float, member_id: str | None,
                           last_failure: str | None) -> RefitTimeout:
    return RefitTimeout(what, timeout_s, member_id=member_id, last_failure=last_failure)


class TransportAborted(RefitError):
    """A transfer could not complete: a peer died, timed out, or the group was aborted."""

    def __init__(self, message: str, *, rank: int | None = None, peer: int | None = None,
                 phase: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.phase = phase


class TransferRefused(TransportAborted):
    """Every byte moved, but a participant voted the refit down at its close (its own check
    failed there, e.g. a source changed under its sends): the refit failed on every rank,
    the communicator is intact."""


class PlanMismatch(RefitError):
    """Ranks computed different plans (fingerprints differ) for the same epoch."""


class SourceChanged(RefitError):
    """A trainer's published buffers changed while their version was in flight (their
    digests after its sends differ from those taken at ``publish``): the version is refused
    for the job, never committed torn."""


class AgentStuck(RefitError):
    """This member's refit agent ran one action far past every deadline it has (a GPU call
    that never returned, a blocking hook): the member left the job so that its peers go on
    without it. The message names the action, for how long, and where the thread was."""


class VerificationFailed(RefitError):
    """A digest of received bytes differs from the sender's: corrupted or missing data."""


class VersionUnreachable(RefitError):
    """``version`` committed, but it cannot reach this inference rank (one that joined or
    restarted since): no live member holds what the rank needs of it (its peers hold their
    own shards, the trainers released it at the commit). The rank receives the next version
    the trainers publish; ``cause`` names the region nobody holds."""

    def __init__(self, version: int, cause: str, *, member_id: str | None = None) -> None:
        who = f"{member_id}: " if member_id else ""
        super().__init__(f"{who}committed version {version} cannot reach this rank: {cause}; it will receive the "
                         "next version the trainers publish")
        self.version = version
        self.cause = cause
        self.member_id = member_id

    def __reduce__(self):
        return _rebuild_unreachable, (self.version, self.cause, self.member_id)


def _rebuild_unreachable(version: int, cause: str, member_id: str | None) -> VersionUnreachable:
    return VersionUnreachable(version, cause, member_id=member_id)


_BRIEF_CHARS = 300


def brief(exc: BaseException | str, *, limit: int | None = _BRIEF_CHARS) -> str:
    """The first line of a fault's message (an exception's, or a message), at most ``limit``
    characters (300; ``None``: the whole line); an exception with no message gives its
    type's name. What a log field or a done key carries of a fault."""
    lines = str(exc).strip().splitlines()
    if lines:
        return lines[0].strip()[:limit]
    return "" if isinstance(exc, str) else type(exc).__name__


def drop_frames(exc: E) -> E:
    """Drop the locals of the finished frames ``exc`` went through, along its whole chain
    (``__cause__``, ``__context__``), and return it; the traceback still says where.

    For a fault of a refit those locals are the transport's posted work, whose gloo context
    keeps its sockets open, and the staging buffers. A handled fault, or one kept for a
    member's lifetime (a latched error), must not hold them: reference cycles through
    tracebacks are common (a future that holds the fault its result raised, a frame that
    holds an exception raised through it), and gc frees a cycle only when it gets to it.
    Raise a kept error with :func:`raise_latched`.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        link = pending.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        tb = link.__traceback__
        while tb is not None:
            # Not a generator's or coroutine's frame: clearing one that is suspended would
            # close it (a retrying etcd call, a watch). Those hold no transport work.
            if not tb.tb_frame.f_code.co_flags & _SUSPENDABLE:
                with contextlib.suppress(RuntimeError):  # a frame still running keeps its locals
                    tb.tb_frame.clear()
            tb = tb.tb_next
        pending += [link.__cause__, link.__context__]
    return exc


def raise_latched(exc: BaseException) -> NoReturn:
    """Raise a copy of latched error ``exc`` (same type, message, fields and cause).

    Raising the kept object itself would grow it at every raise: Python prepends the
    raising frames to its traceback and sets its ``__context__`` to whatever fault the
    raising code was handling (with that fault's frames), all kept for as long as the error
    is. A copy takes those with it when its caller is done with it.
    """
    copy = _blank(type(exc), exc.args)  # not __init__: the args and fields are the kept ones
    copy.args = exc.args
    copy.__dict__.update(vars(exc))
    copy.__cause__ = exc.__cause__
    copy.__suppress_context__ = exc.__suppress_context__
    try:
        raise copy
    finally:
        copy = exc = None  # else copy -> its traceback -> this frame -> copy: a cycle only gc frees


def _blank(cls: type[E], args: tuple) -> E:
    """An instance of exception class ``cls`` without calling its ``__init__``: from the
    ``__new__`` of its layout base (``OSError``'s for a ``TimeoutError`` mixed in; Python
    refuses ``RuntimeError.__new__`` for such a class)."""
    for base in cls.__mro__:
        new = base.__dict__.get("__new__")
        if new is None:
            continue
        with contextlib.suppress(TypeError):
            return new(cls, *args)
    raise TypeError(f"cannot make a blank {cls.__name__}")
