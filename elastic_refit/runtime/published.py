"""A trainer's published versions: the tensors each version is sent from, the digests taken
when it was published, private snapshot copies within their budget, and which versions this
trainer finished sending.

``ElasticRefit.publish`` adds a version here; the participant of an attempt that sources it
takes its tensors from here (:meth:`PublishedVersions.source`) and marks it sent; the driver
releases versions that are over. With a delta budget (``base_bytes``) it also keeps the
base deltas are taken against: a copy of each version as published (a candidate), which
becomes the base once that version is the job's latest commit (:meth:`keep_base`, checked
against the digests taken at publish); the base and the candidate in flight share the
budget, so it takes twice a trainer's buffers for every version to go as a delta. Its own lock; it tells :class:`Outcomes` of every change a
caller may wait for (room in the budget, a version sent), after releasing that lock.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from elastic_refit.runtime.outcomes import Outcomes
from elastic_refit.transport.buffers import buffer_digests

__all__ = ["Published", "PublishedVersions"]


@dataclass(frozen=True, slots=True)
class Published:
    """One version as this trainer published it."""

    tensors: Mapping[str, torch.Tensor]
    layout: str  # the fingerprint of the layout it was published in
    digests: Mapping[str, int]  # buffer -> digest, taken before any byte moved
    copy_bytes: int = 0  # > 0: the tensors are publish's private copy (counted in the budget)


class PublishedVersions:
    """Versions this trainer published and has not seen over yet (its own lock)."""

    def __init__(self, budget_bytes: int, outcomes: Outcomes, base_bytes: int = 0) -> None:
        self.budget_bytes = budget_bytes
        self.base_bytes = base_bytes
        self._candidates: dict[int, Published] = {}  # versions published, copied to become a base
        self._base: tuple[int, Published] | None = None  # the latest committed version, as published
        self._outcomes = outcomes
        self._lock = threading.Lock()
        self._versions: dict[int, Published] = {}
        self._reserved: dict[int, int] = {}  # version -> bytes of its snapshot copy
        self._sent: set[int] = set()
        self._last: tuple[int, str] | None = None  # (version, digest) of the latest publish
        # The caller's own buffers of the latest publish without a copy, weakly: what its next
        # publish is most likely sent from (an executor is bound to them ahead, see
        # last_buffers), never kept alive for it.
        self._last_buffers: dict[str, weakref.ref] = {}

    # ---- publish --------------------------------------------------------------------------
    def reserve(self, version: int, nbytes: int) -> bool:
        """Reserve ``nbytes`` of the snapshot budget for ``version`` if they fit now."""
        with self._lock:
            if sum(self._reserved.values()) + nbytes > self.budget_bytes:
                return False
            self._reserved[version] = nbytes
            return True

    def supersede(self, version: int) -> None:
        """``version`` is being published: older versions are dropped, never queued behind
        (their tensors, digests and copies)."""
        with self._lock:
            self._versions = {v: p for v, p in self._versions.items() if v >= version}
            freed = [v for v in self._reserved if v < version]
            for v in freed:
                del self._reserved[v]
        if freed:
            self._outcomes.changed()

    def add(self, version: int, published: Published) -> None:
        with self._lock:
            self._versions[version] = published
            if not published.copy_bytes:
                self._last_buffers = {name: weakref.ref(t) for name, t in published.tensors.items()}
        self._offer_base(version, published)

    def last_buffers(self) -> dict[str, torch.Tensor]:
        """The caller's buffers of the latest publish that was not copied, while they live
        (empty once any is gone, or when the latest was a copy)."""
        with self._lock:
            refs = dict(self._last_buffers)
        tensors = {name: ref() for name, ref in refs.items()}
        return {} if any(t is None for t in tensors.values()) else tensors  # type: ignore[return-value]

    # ---- the delta base -----------------------------------------------------------------
    def _offer_base(self, version: int, published: Published) -> None:
        """Copy ``published`` as a base candidate if it fits beside the base (a snapshot
        copy is private already: it is kept as it is)."""
        nbytes = sum(t.numel() * t.element_size() for t in published.tensors.values())
        with self._lock:
            held = sum(_nbytes(p) for p in self._candidates.values() if p is not published)
            held += _nbytes(self._base[1]) if self._base is not None else 0
            if not self.base_bytes or held + nbytes > self.base_bytes:
                return
        tensors = published.tensors if published.copy_bytes else {
            name: t.detach().clone(memory_format=torch.contiguous_format) for name, t in published.tensors.items()}
        with self._lock:
            self._candidates = {v: p for v, p in self._candidates.items() if v < version}
            self._candidates[version] = Published(tensors, published.layout, published.digests)

    def keep_base(self, latest_committed: int | None) -> None:
        """The job's latest committed version is ``latest_committed``: its candidate, if
        it still holds what was published, becomes the base; older candidates and bases go."""
        if latest_committed is None:
            return
        with self._lock:
            if self._base is not None and self._base[0] == latest_committed:
                return
            candidate = self._candidates.pop(latest_committed, None)
            self._candidates = {v: p for v, p in self._candidates.items() if v > latest_committed}
            self._base = None
        if candidate is not None and buffer_digests(candidate.tensors) == dict(candidate.digests):
            with self._lock:
                self._base = (latest_committed, candidate)

    def base(self, version: int | None, layout: str) -> Mapping[str, torch.Tensor]:
        """The base tensors when this trainer holds ``version`` as published in ``layout``;
        else {} (it sends full bytes)."""
        with self._lock:
            if version is None or self._base is None or self._base[0] != version or self._base[1].layout != layout:
                return {}
            return self._base[1].tensors

    @property
    def base_version(self) -> int | None:
        with self._lock:
            return None if self._base is None else self._base[0]

    def remember(self, version: int, digest: str) -> None:
        with self._lock:
            self._last = (version, digest)

    @property
    def last(self) -> tuple[int, str] | None:
        """(version, digest) of this trainer's latest publish."""
        with self._lock:
            return self._last

    def drop(self, version: int) -> None:
        """``version`` is no longer this trainer's to send (its publish returned or failed)."""
        with self._lock:
            self._versions.pop(version, None)
            freed = self._reserved.pop(version, None) is not None
        if freed:
            self._outcomes.changed()

    def release_through(self, latest_done: int) -> None:
        """Versions up to ``latest_done`` are over (committed, failed, or superseded by a
        later commit): their copies leave the budget, and their sent marks go."""
        with self._lock:
            copies = [v for v in self._reserved if v <= latest_done]
            for v in copies:
                del self._reserved[v]
                self._versions.pop(v, None)
            self._sent = {v for v in self._sent if v > latest_done}
        if copies:
            self._outcomes.changed()

    # ---- an attempt that sources a version -----------------------------------------------
    def get(self, version: int) -> Published | None:
        with self._lock:
            return self._versions.get(version)

    def in_flight(self) -> list[int]:
        with self._lock:
            return sorted(self._versions)

    def is_copy(self, version: int) -> bool:
        """Whether ``version`` is sent from publish's own copy (nobody else writes it)."""
        with self._lock:
            return version in self._reserved

    def mark_sent(self, version: int) -> None:
        with self._lock:
            self._sent.add(version)
        self._outcomes.changed()

    def sent(self, version: int) -> bool:
        with self._lock:
            return version in self._sent

    def changed_buffers(self, version: int, source: Mapping[str, torch.Tensor]) -> list[str]:
        """Buffers of ``source`` that no longer hold what was published as ``version``
        (their digests now against those taken at publish); [] when it is not held here."""
        published = self.get(version)
        if published is None:
            return []
        now = buffer_digests(source)
        return sorted(name for name, d in published.digests.items() if now.get(name) != d)


def _nbytes(published: Published) -> int:
    return sum(t.numel() * t.element_size() for t in published.tensors.values())
