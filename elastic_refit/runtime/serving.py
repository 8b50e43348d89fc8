"""An inference rank's serving slot: the parameters the engine reads, the buffers a refit
writes, the readers inside ``weights()``, and the committed version the parameters hold.

``in_place``: a refit writes the parameters themselves; from the moment it starts writing
(:meth:`ServingSlot.begin_apply`) no new reader enters until a version it holds commits.
The pause it causes (block to commit) is reported per version.

``staged``: a refit writes spare buffers beside the served parameters while readers go on.
At commit the switch (one copy of the rank's weights, spare -> parameters, at memory speed)
runs *between reads*: at once when no reader is inside, else by the last reader as it
leaves. Nobody waits for a reader: the agent thread returns from :meth:`serve` at once, and
a reader in the middle of a long generation keeps the version it entered with, untouched,
until it leaves (never torn). Readers that enter while a switch is pending join the version
being read (no wait; the version ``weights()`` yields says which), so the switch needs a
moment with no reader inside: an engine with one generation loop has one between every two
``weights()`` blocks; one with overlapping readers should hold ``weights()`` per engine step.
A refit that starts writing the spares while a switch is still pending skips that version
(the readers never saw it; the next one is switched in instead). The only time readers are
held back is the copy itself, under the slot's lock: ``refit.serving.paused``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping

import torch

from elastic_refit.runtime.events import EventLog
from elastic_refit.runtime.outcomes import Outcomes
from elastic_refit.transport.buffers import buffers_digest

__all__ = ["ServedVersion", "ServingSlot"]


class ServedVersion(int):
    """What ``weights()`` yields: the committed version the parameters hold (an ``int``),
    and ``detached``: why this rank was out of the job when the read began (its lease lost
    and it registers again, or etcd silent past the TTL), None while it was in. A detached
    rank serves under ``serve_when_detached='keep'`` only: its version may be behind the
    job's, and a newer one cannot reach it until it is back."""

    detached: str | None

    def __new__(cls, version: int, detached: str | None = None) -> ServedVersion:
        served = super().__new__(cls, version)
        served.detached = detached
        return served


class ServingSlot:
    """The parameters of one inference rank and who reads them (its own condition)."""

    def __init__(self, parameters: Mapping[str, torch.Tensor], *, staged: bool, outcomes: Outcomes,
                 log: EventLog | None = None) -> None:
        self.staged = staged
        self._outcomes = outcomes
        self._log = log
        self._cond = threading.Condition()
        self._readers = 0
        self._read_since: float | None = None  # since when readers have been inside without a break
        self._blocked = False  # in place: the parameters are being (or were partly) overwritten
        self._blocked_at: float | None = None  # in place: when readers were first held back
        self._serving: int | None = None  # the committed version the parameters hold
        self._pending: tuple[int, float] | None = None  # staged: (version, committed at) not switched in yet
        self._dirty = False  # a refit started writing and has not completed (what is written is no version)
        self._digest: str | None = None  # what digest() took, while no refit has written since
        self._parameters: dict[str, torch.Tensor] = dict(parameters)
        self._incoming = self._spares(self._parameters)
        self.switches = 0  # staged: how many versions were switched in (tests and benchmarks read it)

    def _spares(self, parameters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in parameters.items()} if self.staged else parameters

    @property
    def parameters(self) -> dict[str, torch.Tensor]:
        """What readers read."""
        return self._parameters

    @property
    def incoming(self) -> dict[str, torch.Tensor]:
        """What a refit writes (the parameters themselves in place). Staged, it also holds
        the latest version this rank received (what it sends as a holder)."""
        return self._incoming

    @property
    def serving(self) -> int | None:
        with self._cond:
            return self._serving

    @property
    def pending(self) -> int | None:
        """Staged: the committed version waiting for a moment without readers."""
        with self._cond:
            return None if self._pending is None else self._pending[0]

    def digest(self) -> str:
        """The digest of what a complete, verified refit wrote: what this rank acks. From
        here on what it wrote may be served (before, a commit the watch still shows from an
        earlier ack must not serve half-written buffers)."""
        digest = buffers_digest(self._incoming)
        with self._cond:
            self._dirty = False
            self._digest = digest
        return digest

    def held_digest(self) -> str:
        """The digest of what the refit buffers hold now, without reading them while no
        refit has written them since :meth:`digest` took it (what this rank acked: the
        runtime's buffers change only through refits); else read anew."""
        with self._cond:
            if self._digest is not None:
                return self._digest
        return buffers_digest(self._incoming)

    # ---- readers ------------------------------------------------------------------------
    def enter(self, want: int = -1) -> int | None:
        """Become a reader if a committed version >= ``want`` is served and no update is
        being applied in place; returns that version (None: not now)."""
        with self._cond:
            if self._serving is None or self._blocked or self._serving < want:
                return None
            self._readers += 1
            if self._read_since is None:
                self._read_since = time.monotonic()
            return self._serving

    @contextlib.contextmanager
    def reading(self, detached: Callable[[], str | None], *, keep: bool, timeout_s: float) -> Iterator[ServedVersion]:
        """Be a reader for the block (see ``ElasticRefit.weights``): wait (at most
        ``timeout_s``) for a served version, and while ``detached()`` names a reason, serve
        only if ``keep``; the version yielded says whether the rank was detached."""
        def enter() -> ServedVersion | None:
            why = detached()
            if why is not None and not keep:
                return None
            version = self.enter()
            return None if version is None else ServedVersion(version, why)

        served = self._outcomes.wait_for(enter, timeout_s, "a committed version to serve")
        try:
            yield served
        finally:
            self.leave()

    def leave(self) -> None:
        """Stop reading; the last reader out switches in a pending version (staged)."""
        with self._cond:
            self._readers -= 1
            if self._readers == 0:
                self._read_since = None
            switched = self._switch_if_free()
            self._cond.notify_all()
        self._report(switched)

    def served(self, want: int) -> int | None:
        """The version served if it is >= ``want`` and readable now, without entering."""
        with self._cond:
            if self._serving is None or self._blocked or self._serving < want:
                return None
            return self._serving

    def _wait_no_readers(self) -> None:
        # Readers leave on their own; each leave notifies. Not a poll.
        self._cond.wait_for(lambda: self._readers == 0)

    def wait_readers_out(self, timeout_s: float) -> float:
        """Before an in-place refit agrees to write: wait (at most ``timeout_s``) for the
        readers inside to leave, holding no new one back (nothing is written yet). 0.0 once
        none is inside, else how long readers have been inside without a break."""
        with self._cond:
            if self._cond.wait_for(lambda: self._readers == 0, timeout_s):
                return 0.0
            return time.monotonic() - self._read_since if self._read_since is not None else timeout_s

    # ---- the writer ----------------------------------------------------------------------
    def begin_apply(self) -> None:
        """A refit starts writing. In place: stop new reads, wait for current ones (the
        pause starts). Staged: the spares are overwritten, so a version still waiting for
        its switch is skipped; never waits."""
        with self._cond:
            self._dirty, self._digest = True, None
            if self.staged:
                if self._pending is not None and self._log is not None:
                    self._log.info("refit.serving.skipped", version=self._pending[0], readers=self._readers)
                self._pending = None
                return
            if self._blocked_at is None:
                self._blocked_at = time.perf_counter()
            self._blocked = True
            self._wait_no_readers()

    def serve(self, version: int) -> bool:
        """This rank holds committed ``version``: serve it. Staged: switch it in now if no
        reader is inside, else when the last one leaves (never waits). Returns whether the
        version was taken (served now or pending)."""
        with self._cond:
            if (self._dirty or self._serving == version
                    or (self._pending is not None and self._pending[0] == version)):
                return False
            switched = None
            if self.staged:
                self._pending = (version, time.perf_counter())
                switched = self._switch_if_free()
            else:
                paused = 0.0 if self._blocked_at is None else time.perf_counter() - self._blocked_at
                self._serving, self._blocked, self._blocked_at = version, False, None
                switched = (version, paused, 0.0)
        self._outcomes.changed()
        self._report(switched)
        return True

    def _switch_if_free(self) -> tuple[int, float, float] | None:
        """(Under the lock.) Copy the pending version in if no reader is inside: readers
        that try to enter meanwhile wait on the lock, for the copy alone. Returns
        (version, seconds readers were held back, seconds it waited for readers)."""
        if self._pending is None or self._readers > 0:
            return None
        version, committed_at = self._pending
        t0 = time.perf_counter()
        with torch.no_grad():
            for name, tensor in self._parameters.items():
                tensor.copy_(self._incoming[name])
            _synchronize(self._parameters)
        t1 = time.perf_counter()
        self._serving, self._pending = version, None
        self.switches += 1
        return version, t1 - t0, t0 - committed_at

    def _report(self, switched: tuple[int, float, float] | None) -> None:
        if switched is None:
            return
        if self.staged:
            self._outcomes.changed()  # a deferred switch: wait_for_version may be waiting for it
        if self._log is not None:
            version, paused, deferred = switched
            self._log.info("refit.serving.paused", version=version, seconds=paused, deferred_s=deferred,
                           mode="staged" if self.staged else "in_place")

    def replace(self, parameters: Mapping[str, torch.Tensor]) -> None:
        """New parameters (a new layout): they hold no version until the next one arrives."""
        with self._cond:
            self._wait_no_readers()
            self._parameters = dict(parameters)
            self._incoming = self._spares(self._parameters)
            self._serving, self._pending, self._dirty, self._digest = None, None, False, None
        self._outcomes.changed()


def _synchronize(tensors: Mapping[str, torch.Tensor]) -> None:
    """The copy is over only once the device ran it: a reader entering next may read from
    another stream, and the pause is measured to here."""
    devices = {t.device for t in tensors.values() if t.device.type == "cuda"}
    for device in devices:
        torch.cuda.synchronize(device)
