"""Wake a waiting agent when keys it depends on change, instead of polling etcd.

An agent that polled its job's keys every few milliseconds would cost etcd requests in
proportion to ranks times the poll rate, idle or not. :class:`ChangeSignal` watches a few
key prefixes (list-then-watch through :class:`~membership.watch.RangeWatcher`, which
resumes after etcd trouble and relists after compaction) and counts changes; a waiter
takes a :meth:`~ChangeSignal.token` *before* it reads what it needs from etcd and, when
there is nothing to do, blocks in :meth:`~ChangeSignal.wait_after` until the count moves
past it. A change that lands between the read and the wait has already moved the count,
so no wakeup is lost. Reads stay the source of truth; the watches only say when to read.
"""

from __future__ import annotations

import threading

from elastic_refit.membership.client import EtcdClient, _prefix_end
from elastic_refit.membership.watch import RangeSnapshot, RangeWatcher

__all__ = ["ChangeSignal"]


class ChangeSignal:
    """A change counter bumped by watches of key prefixes and by :meth:`bump`.

    Watches are named, so a prefix that lives only as long as an epoch (its store) can be
    replaced when the epoch changes. Progress requests keep each stream honest; their
    interval is long because a waiter never relies on a single wakeup alone (it waits with
    a timeout, see :meth:`wait_after`)."""

    def __init__(self, client: EtcdClient, *, progress_interval_s: float = 5.0, stall_timeout_s: float = 15.0):
        if not 0 < progress_interval_s < stall_timeout_s:
            raise ValueError(f"need 0 < progress_interval_s < stall_timeout_s, got {progress_interval_s} "
                             f"and {stall_timeout_s}")
        self._client = client
        self.progress_interval_s = progress_interval_s  # other watches of the waiter use the same
        self.stall_timeout_s = stall_timeout_s
        self._cond = threading.Condition()
        self._count = 0
        self._watches: dict[str, tuple[str, RangeWatcher]] = {}
        self._closed = False

    def watch(self, name: str, prefix: str) -> None:
        """Bump on every change under ``prefix`` (replacing watch ``name``'s prefix if it
        had another one); returns once the watch is listening."""
        current = self._watches.get(name)
        if current is not None and current[0] == prefix:
            return
        self.unwatch(name)
        watcher = RangeWatcher(self._client, prefix, _prefix_end(prefix.encode()).decode(), name=f"wake:{name}",
                               progress_interval_s=self.progress_interval_s,
                               stall_timeout_s=self.stall_timeout_s)
        # A stopped watch may still deliver what it had in flight: only the current one counts.
        watcher.add_listener(lambda _reset, _events, _snap: self._bump_from(name, watcher))
        self._watches[name] = (prefix, watcher)
        watcher.start()
        self.bump()  # what changed before the watch started is read by the next pass anyway

    def snapshot(self, name: str, prefix: str) -> RangeSnapshot | None:
        """The keys watch ``name`` holds, if it watches ``prefix`` now (else ``None``): what
        woke a waiter is in it, read without a request. Treat its items as read-only."""
        entry = self._watches.get(name)
        return entry[1].snapshot() if entry is not None and entry[0] == prefix else None

    def unwatch(self, name: str) -> None:
        entry = self._watches.pop(name, None)
        if entry is not None:
            entry[1].stop()

    def _bump_from(self, name: str, watcher: RangeWatcher) -> None:
        entry = self._watches.get(name)
        if entry is not None and entry[1] is watcher:
            self.bump()

    def bump(self) -> None:
        """Wake every waiter (a local change, e.g. a new membership view)."""
        with self._cond:
            self._count += 1
            self._cond.notify_all()

    def token(self) -> int:
        """The current count: take it before reading, then ``wait_after`` it."""
        with self._cond:
            return self._count

    def wait_after(self, token: int, timeout_s: float) -> bool:
        """Block until something changed after ``token`` (True) or ``timeout_s`` passed
        (False), or the signal was closed (True)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._count != token or self._closed, timeout_s)

    def close(self) -> None:
        for name in list(self._watches):
            self.unwatch(name)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
