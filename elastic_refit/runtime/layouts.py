"""The layouts a rank plans with: its own side's, and its peers' fetched from etcd by fingerprint.

Every member publishes the layout of its own side (``layouts/{fingerprint}``) and names
the fingerprint in its member record; an attempt names the fingerprint each participant is
planned with. A layout is immutable under its fingerprint, so a fetched one is kept; the
cache keeps the layouts this rank declared itself (never evicted) plus the most recently
used fetched ones.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from elastic_refit.layout import Layout, decode_layout, encode_layout
from elastic_refit.membership.layouts import LayoutStore, LayoutUnavailable
from elastic_refit.membership.service import Membership
from elastic_refit.membership.view import MemberRecord

__all__ = ["LayoutCache"]


class LayoutCache:
    """Layouts by fingerprint for one rank (thread-safe: the agent and the caller's thread)."""

    def __init__(self, store: LayoutStore, known: Iterable[Layout] = (), max_fetched: int = 8) -> None:
        self.store = store
        self._known: dict[str, Layout] = {}
        self._fetched: OrderedDict[str, Layout] = OrderedDict()
        self._max_fetched = max_fetched
        self._lock = threading.Lock()
        for layout in known:
            self.add(layout)

    def add(self, layout: Layout) -> str:
        """Keep ``layout`` (one this rank declared); returns its fingerprint."""
        with self._lock:
            self._known[layout.fingerprint] = layout
        return layout.fingerprint

    def publish(self, membership: Membership, layout: Layout) -> str:
        """Keep ``layout`` and make it fetchable by peers (before any record names it)."""
        fingerprint = self.add(layout)
        self.store.put(membership, fingerprint, encode_layout(layout))
        return fingerprint

    def get(self, fingerprint: str) -> Layout:
        """The layout ``fingerprint`` names; :class:`LayoutUnavailable` if etcd does not
        hold it (or holds bytes that decode to another layout)."""
        with self._lock:
            layout = self._known.get(fingerprint) or self._fetched.get(fingerprint)
            if layout is not None:
                if fingerprint in self._fetched:
                    self._fetched.move_to_end(fingerprint)
                return layout
        if not fingerprint:
            raise LayoutUnavailable("a member record names no layout (a member of an older version of elastic-refit?)")
        try:
            layout = decode_layout(self.store.get(fingerprint), fingerprint)
        except ValueError as exc:
            raise LayoutUnavailable(f"layout {fingerprint} in etcd is unusable: {exc}") from None
        with self._lock:
            self._fetched[fingerprint] = layout
            while len(self._fetched) > self._max_fetched:
                self._fetched.popitem(last=False)
        return layout

    def layout_of(self, record: MemberRecord, fingerprint: str) -> Layout:
        """``plan_attempt``'s ``layout_of``: the layout the attempt names for ``record``."""
        return self.get(fingerprint or record.layout)
