"""The layouts a rank plans with: its own side's, and its peers' fetched from etcd by fingerprint.

Every member publishes the self-description of its own side (``layouts/{fingerprint}``: its
layout, and an inference side's destination formats, see ``layout.encoding``) and names its
fingerprint in its member record; an attempt names the fingerprint each participant is
planned with. A description is immutable under its fingerprint, so a fetched one is kept;
the cache keeps the descriptions this rank declared itself (never evicted) plus the most
recently used fetched ones.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from elastic_refit.layout import (
    Layout,
    TensorFormats,
    decode_described,
    described_fingerprint,
    encode_layout,
)
from elastic_refit.membership.layouts import LayoutStore, LayoutUnavailable
from elastic_refit.membership.service import Membership
from elastic_refit.membership.view import MemberRecord

__all__ = ["LayoutCache"]

_NO_FORMATS = TensorFormats()


class LayoutCache:
    """Self-described layouts (a layout and its destination formats) by fingerprint for one
    rank (thread-safe: the agent and the caller's thread)."""

    def __init__(self, store: LayoutStore, known: Iterable[Layout] = (), max_fetched: int = 8) -> None:
        self.store = store
        self._known: dict[str, tuple[Layout, TensorFormats]] = {}
        self._fetched: OrderedDict[str, tuple[Layout, TensorFormats]] = OrderedDict()
        self._max_fetched = max_fetched
        self._lock = threading.Lock()
        for layout in known:
            self.add(layout)

    def add(self, layout: Layout, formats: TensorFormats | None = None) -> str:
        """Keep ``layout`` with ``formats`` (a description this rank declared); returns its
        fingerprint (``described_fingerprint``)."""
        formats = formats or _NO_FORMATS
        fingerprint = described_fingerprint(layout, formats)
        with self._lock:
            self._known[fingerprint] = (layout, formats)
        return fingerprint

    def publish(self, membership: Membership, layout: Layout, formats: TensorFormats | None = None) -> str:
        """Keep ``layout`` (with ``formats``) and make it fetchable by peers (before any
        record names it); returns its fingerprint."""
        fingerprint = self.add(layout, formats)
        self.store.put(membership, fingerprint, encode_layout(layout, formats))
        return fingerprint

    def described(self, fingerprint: str) -> tuple[Layout, TensorFormats]:
        """The layout and destination formats ``fingerprint`` names;
        :class:`LayoutUnavailable` if etcd does not hold it (or holds bytes that decode to
        another description)."""
        with self._lock:
            entry = self._known.get(fingerprint) or self._fetched.get(fingerprint)
            if entry is not None:
                if fingerprint in self._fetched:
                    self._fetched.move_to_end(fingerprint)
                return entry
        if not fingerprint:
            raise LayoutUnavailable("a member record names no layout (a member of an older version of elastic-refit?)")
        try:
            entry = decode_described(self.store.get(fingerprint), fingerprint)
        except ValueError as exc:
            raise LayoutUnavailable(f"layout {fingerprint} in etcd is unusable: {exc}") from None
        with self._lock:
            self._fetched[fingerprint] = entry
            while len(self._fetched) > self._max_fetched:
                self._fetched.popitem(last=False)
        return entry

    def get(self, fingerprint: str) -> Layout:
        """The layout ``fingerprint`` names (see :meth:`described`)."""
        return self.described(fingerprint)[0]

    def layout_of(self, record: MemberRecord, fingerprint: str) -> Layout:
        """``plan_attempt``'s ``layout_of``: the layout the attempt names for ``record``."""
        return self.get(fingerprint or record.layout)

    def formats_of(self, record: MemberRecord, fingerprint: str) -> TensorFormats:
        """``plan_attempt``'s ``formats_of``: the destination formats the attempt's
        description of ``record`` declares (empty for trainers and BF16 inference sides)."""
        return self.described(fingerprint or record.layout)[1]
