"""An inference rank's serving slot: the parameters the engine reads, the buffers a refit
writes, the readers inside ``weights()``, and the committed version the parameters hold.

``in_place``: a refit writes the parameters themselves; from the moment it starts writing
(:meth:`ServingSlot.begin_apply`) no new reader enters until a version it holds commits.
``staged``: a refit writes spare buffers, swapped in (one copy) between reads once the
version commits, so serving never stops for a transfer. Its own condition (readers leave,
the writer waits); it tells :class:`Outcomes` when the served version changes.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from elastic_refit.runtime.outcomes import Outcomes
from elastic_refit.transport.buffers import buffers_digest

__all__ = ["ServingSlot"]


class ServingSlot:
    """The parameters of one inference rank and who reads them (its own condition)."""

    def __init__(self, parameters: Mapping[str, torch.Tensor], *, staged: bool, outcomes: Outcomes) -> None:
        self.staged = staged
        self._outcomes = outcomes
        self._cond = threading.Condition()
        self._readers = 0
        self._blocked = False  # in place: the parameters are being (or were partly) overwritten
        self._serving: int | None = None  # the committed version the parameters hold
        self._parameters: dict[str, torch.Tensor] = dict(parameters)
        self._incoming = self._spares(self._parameters)

    def _spares(self, parameters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in parameters.items()} if self.staged else parameters

    @property
    def parameters(self) -> dict[str, torch.Tensor]:
        """What readers read."""
        return self._parameters

    @property
    def incoming(self) -> dict[str, torch.Tensor]:
        """What a refit writes (the parameters themselves in place)."""
        return self._incoming

    @property
    def serving(self) -> int | None:
        with self._cond:
            return self._serving

    def digest(self) -> str:
        """The digest of what a refit wrote: what this rank acks."""
        return buffers_digest(self._incoming)

    # ---- readers ------------------------------------------------------------------------
    def enter(self, want: int = -1) -> int | None:
        """Become a reader if a committed version >= ``want`` is served and no update is
        being applied in place; returns that version (None: not now)."""
        with self._cond:
            if self._serving is None or self._blocked or self._serving < want:
                return None
            self._readers += 1
            return self._serving

    def leave(self) -> None:
        with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    def served(self, want: int) -> int | None:
        """The version served if it is >= ``want`` and readable now, without entering."""
        with self._cond:
            if self._serving is None or self._blocked or self._serving < want:
                return None
            return self._serving

    def _wait_no_readers(self) -> None:
        # Readers leave on their own; each leave notifies. Not a poll.
        self._cond.wait_for(lambda: self._readers == 0)

    # ---- the writer ----------------------------------------------------------------------
    def begin_apply(self) -> None:
        """In place, writing the parameters starts: stop new reads, wait for current ones."""
        if self.staged:
            return
        with self._cond:
            self._blocked = True
            self._wait_no_readers()

    def serve(self, version: int) -> bool:
        """This rank holds committed ``version``: serve it (staged: swap it in between
        reads). Returns whether the served version changed."""
        with self._cond:
            if self._serving == version:
                return False
            if self.staged:
                self._wait_no_readers()
                for name, tensor in self._parameters.items():
                    tensor.copy_(self._incoming[name])
            self._serving, self._blocked = version, False
        self._outcomes.changed()
        return True

    def replace(self, parameters: Mapping[str, torch.Tensor]) -> None:
        """New parameters (a new layout): they hold no version until the next one arrives."""
        with self._cond:
            self._wait_no_readers()
            self._parameters = dict(parameters)
            self._incoming = self._spares(self._parameters)
            self._serving = None
        self._outcomes.changed()
