"""The layouts a rank plans with: its own side's, and its peers' fetched from etcd by fingerprint.

Every member publishes the self-description of its own side (``layouts/{fingerprint}``: its
layout, and an inference side's destination formats, see ``layout.encoding``) and names its
fingerprint in its member record; an attempt names the fingerprint each participant is
planned with. A description is immutable under its fingerprint, so a fetched one is kept;
the cache keeps the descriptions this rank declared itself (never evicted) plus the most
recently used fetched ones.

A side known as rules (a ``SymbolicLayout``, or a layout built from one: ``rules_of``) is
published as its rules (``ERL3``: kilobytes whatever the number of ranks) and materialised
into pieces only when a plan asks for its layout; a side built piece by piece is published
as its pieces (``ERL1``/``ERL2``, as members of earlier versions do). Peers read every format.
``publish_rules=False`` publishes pieces always (a job with members that cannot read ``ERL3``).
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
from elastic_refit.layout.encoding import decode_symbolic_described, encode_symbolic
from elastic_refit.layout.symbolic import SymbolicLayout, rules_of
from elastic_refit.membership.layouts import LayoutStore, LayoutUnavailable
from elastic_refit.membership.service import Membership
from elastic_refit.membership.view import MemberRecord

__all__ = ["LayoutCache"]

_NO_FORMATS = TensorFormats()
_SYMBOLIC_MAGIC = b"ERL3"


class _Entry:
    """One description: its layout (materialised from its rules on first use), formats, rules."""

    __slots__ = ("formats", "layout", "rules")

    def __init__(self, layout: Layout | None, formats: TensorFormats, rules: SymbolicLayout | None) -> None:
        self.layout, self.formats, self.rules = layout, formats, rules


class LayoutCache:
    """Self-described layouts (a layout and its destination formats) by fingerprint for one
    rank (thread-safe: the agent and the caller's thread)."""

    def __init__(self, store: LayoutStore, known: Iterable[Layout | SymbolicLayout] = (), max_fetched: int = 8,
                 publish_rules: bool = True) -> None:
        self.store = store
        self.publish_rules = publish_rules
        self._known: dict[str, _Entry] = {}
        self._fetched: OrderedDict[str, _Entry] = OrderedDict()
        self._max_fetched = max_fetched
        self._lock = threading.Lock()
        for layout in known:
            self.add(layout)

    def add(self, layout: Layout | SymbolicLayout, formats: TensorFormats | None = None) -> str:
        """Keep ``layout`` (pieces or rules) with ``formats`` (a description this rank
        declared); returns its fingerprint (``described_fingerprint``)."""
        formats = formats or _NO_FORMATS
        fingerprint = described_fingerprint(layout, formats)  # type: ignore[arg-type]
        if isinstance(layout, SymbolicLayout):
            entry = _Entry(None, formats, layout)
        elif isinstance(layout, Layout):
            entry = _Entry(layout, formats, rules_of(layout))
        else:
            raise ValueError(f"layout must be a Layout or SymbolicLayout, got {type(layout).__name__}")
        with self._lock:
            self._known[fingerprint] = entry
        return fingerprint

    def publish(self, membership: Membership, layout: Layout | SymbolicLayout,
                formats: TensorFormats | None = None) -> str:
        """Keep ``layout`` (with ``formats``) and make it fetchable by peers (before any
        record names it): as its rules where it has them (and ``publish_rules``), else as
        its pieces; returns its fingerprint."""
        fingerprint = self.add(layout, formats)
        with self._lock:
            entry = self._known[fingerprint]
        if entry.rules is not None and self.publish_rules:
            blob = encode_symbolic(entry.rules, formats)
        else:
            blob = encode_layout(self._materialised(fingerprint, entry), formats)
        self.store.put(membership, fingerprint, blob)
        return fingerprint

    def described(self, fingerprint: str) -> tuple[Layout, TensorFormats]:
        """The layout and destination formats ``fingerprint`` names;
        :class:`LayoutUnavailable` if etcd does not hold it (or holds bytes that decode to
        another description)."""
        entry = self._entry(fingerprint)
        return self._materialised(fingerprint, entry), entry.formats

    def rules(self, fingerprint: str) -> SymbolicLayout | None:
        """The rules of the side ``fingerprint`` names (fetched if need be), None for a side
        described piece by piece; :class:`LayoutUnavailable` as :meth:`described`."""
        return self._entry(fingerprint).rules

    def get(self, fingerprint: str) -> Layout:
        """The layout ``fingerprint`` names (see :meth:`described`)."""
        return self.described(fingerprint)[0]

    def layout_of(self, record: MemberRecord, fingerprint: str) -> Layout:
        """``plan_attempt``'s ``layout_of``: the layout the attempt names for ``record``."""
        return self.get(fingerprint or record.layout)

    def formats_of(self, record: MemberRecord, fingerprint: str) -> TensorFormats:
        """``plan_attempt``'s ``formats_of``: the destination formats the attempt's
        description of ``record`` declares (empty for trainers and BF16 inference sides)."""
        return self._entry(fingerprint or record.layout).formats

    # ---- internals -------------------------------------------------------------------
    def _entry(self, fingerprint: str) -> _Entry:
        with self._lock:
            entry = self._known.get(fingerprint) or self._fetched.get(fingerprint)
            if entry is not None:
                if fingerprint in self._fetched:
                    self._fetched.move_to_end(fingerprint)
                return entry
        if not fingerprint:
            raise LayoutUnavailable("a member record names no layout (a member of an older version of elastic-refit?)")
        blob = self.store.get(fingerprint)
        try:
            if bytes(blob[:4]) == _SYMBOLIC_MAGIC:  # rules: pieces only when a plan asks for them
                rules, formats = decode_symbolic_described(blob, fingerprint)
                entry = _Entry(None, formats, rules)
            else:
                layout, formats = decode_described(blob, fingerprint)
                entry = _Entry(layout, formats, None)
        except ValueError as exc:
            raise LayoutUnavailable(f"layout {fingerprint} in etcd is unusable: {exc}") from None
        with self._lock:
            self._fetched[fingerprint] = entry
            while len(self._fetched) > self._max_fetched:
                self._fetched.popitem(last=False)
        return entry

    def _materialised(self, fingerprint: str, entry: _Entry) -> Layout:
        """``entry``'s layout, built from its rules the first time (outside the lock: the
        build is the same on every thread, the first one stored is kept)."""
        layout = entry.layout
        if layout is None:
            assert entry.rules is not None
            built = entry.rules.to_layout()
            with self._lock:
                if entry.layout is None:
                    entry.layout = built
                layout = entry.layout
        return layout
