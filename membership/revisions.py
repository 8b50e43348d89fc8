"""The store's revision never goes back: the check that finds etcd restored from an older state.

etcd's revision grows by one per write and is never reused, and a linearizable answer carries
a revision at least that of every write committed before the request was sent (on any member of a
cluster: a follower answers only once it applied up to the leader's read index). So once a
process saw revision R, an answer below R means the store is not the one it talked to: etcd
was restored from an older snapshot or backup of its data directory, or wiped. The job's run
id (``JobKeys.run``) catches a wipe and a restore from another run; only this catches a
restore of the same run from before some of its writes, when the latest committed version
may even be unchanged. Going on would commit or serve versions out of order, so the finding
is latched: every later guarded call raises it, even once the restored store's revision has
grown past R again.

Watch answers are not linearizable (a lagging follower's stream reports its own, older
revision): a watcher that sees one below its own confirms with a linearizable read
(``EtcdClient.arevision``) before anything is concluded.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from elastic_refit.membership.errors import JOB_STATE_LOST_ADVICE, JobStateLost

from elastic_refit.errors import raise_latched


class RevisionGuard:
    """The highest revision one client saw in a linearizable answer, and the latched finding
    that the store went back. Thread-safe; the client calls :meth:`saw` with each answer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._highest = 0
        self._went_back: JobStateLost | None = None
        self._listeners: list[Callable[[JobStateLost], None]] = []

    @property
    def highest(self) -> int:
        """The highest revision seen so far (0 before the first answer)."""
        with self._lock:
            return self._highest

    @property
    def went_back(self) -> JobStateLost | None:
        """The latched finding, once an answer went below :attr:`highest`; else ``None``."""
        with self._lock:
            return self._went_back

    def check(self) -> None:
        """Raise the latched finding (a copy: the kept one never picks up a raiser's frames), if any."""
        error = self.went_back
        if error is not None:
            raise_latched(error)

    def saw(self, revision: int, where: str, *, floor: int) -> None:
        """Record the revision of a linearizable answer from ``where`` (an endpoint) to a
        request sent when :attr:`highest` was ``floor``; raises (and latches) ``JobStateLost``
        when it is below ``floor``. Not below :attr:`highest`: a request in flight beside
        another may be answered before it, at a lower revision, and be right."""
        with self._lock:
            if self._went_back is None and revision >= floor:
                self._highest = max(self._highest, revision)
                return
        self._latch(f"etcd at {where} answered at revision {revision}, below revision {floor} that this "
                    "process saw before")

    def key_went_back(self, key: str, mod_revision: int, seen: int, where: str) -> None:
        """A linearizable answer from ``where`` holds ``key`` at ``mod_revision`` (0: absent)
        where this process saw it written at ``seen``: a key's modification revision never
        decreases, so the store went back (found even once the restored store's revision has
        grown past every one seen before). Raises (and latches) ``JobStateLost``; a no-op when
        ``mod_revision >= seen``."""
        if mod_revision >= seen:
            return
        answered = f"at mod revision {mod_revision}" if mod_revision else "absent"
        self._latch(f"etcd at {where} holds {key} {answered}, where this process saw it written at revision {seen}")

    def _latch(self, cause: str) -> None:
        """Latch ``JobStateLost`` for ``cause`` (the first cause wins), tell the listeners once
        and raise it."""
        with self._lock:
            if self._went_back is None:
                self._went_back = JobStateLost(
                    f"the job's control state in etcd is not the one it joined: {cause} (etcd was restored "
                    "from an older snapshot or copy of its data directory, or wiped); " + JOB_STATE_LOST_ADVICE)
                listeners = list(self._listeners)
            else:
                listeners = []
            error = self._went_back
        for listener in listeners:  # outside the lock: a listener may read the guard
            with contextlib.suppress(Exception):
                listener(error)
        raise_latched(error)

    def floor(self, revision: int) -> None:
        """Raise :attr:`highest` to ``revision`` without checking it: a revision some answer
        proved committed (a watch event's), which every later linearizable answer reaches."""
        with self._lock:
            self._highest = max(self._highest, revision)

    def on_went_back(self, listener: Callable[[JobStateLost], None]) -> Callable[[], None]:
        """Call ``listener`` once when the store is found to have gone back (at once if it
        was already); returns a function that removes it."""
        with self._lock:
            error = self._went_back
            if error is None:
                self._listeners.append(listener)
        if error is not None:
            listener(error)

        def remove() -> None:
            with self._lock, contextlib.suppress(ValueError):
                self._listeners.remove(listener)

        return remove
