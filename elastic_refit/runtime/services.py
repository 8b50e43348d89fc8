"""What a started member talks to: etcd (membership, versions, the attempt ledger, the
watches that wake it), its communicators, its log and its hooks. Made once in
``ElasticRefit.start`` and handed to the driver, the coordinator and the participant; none
of them owns these, and none keeps state here."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from elastic_refit.errors import RefitError
from elastic_refit.membership import CommunicatorManager, EtcdClient, EtcdStore, Membership
from elastic_refit.membership.attempts import AttemptLedger
from elastic_refit.membership.client import KeyValue
from elastic_refit.membership.versions import VersionStore, VersionTracker
from elastic_refit.membership.wakeup import ChangeSignal
from elastic_refit.runtime.config import RefitConfig
from elastic_refit.runtime.events import EventLog
from elastic_refit.runtime.layouts import LayoutCache
from elastic_refit.runtime.phases import PhaseHooks

__all__ = ["AttemptAborted", "Services"]

_EPOCH_WATCH = "epoch"


class AttemptAborted(RefitError):
    """This rank stopped an attempt because of something outside it (a peer failed it
    first, the epoch moved on, the runtime closes): a consequence, never a cause."""


@dataclass(frozen=True, slots=True)
class Services:
    """A started member's connections and shared tools (frozen: parts call them, never
    swap them). ``stats`` are counters the agent thread alone writes."""

    config: RefitConfig
    client: EtcdClient
    membership: Membership
    versions: VersionStore
    ledger: AttemptLedger
    tracker: VersionTracker
    changes: ChangeSignal
    layouts: LayoutCache
    manager: CommunicatorManager
    log: EventLog
    hooks: PhaseHooks
    stop: threading.Event
    stats: dict[str, Any] = field(default_factory=dict)

    def fire(self, phase: str, **context: Any) -> None:
        """Run the context's hooks at ``phase`` (what a hook raises fails the phase)."""
        self.hooks.fire(phase, {"member_id": self.config.member_id, "role": self.config.role, **context})

    def superseded(self, epoch: int) -> bool:
        latest = self.membership.view
        return latest is not None and latest.epoch > epoch

    def watch_epoch(self, epoch: int) -> None:
        """Wake the agent on every change of ``epoch``'s store (attempts, plan, done keys)."""
        self.changes.watch(_EPOCH_WATCH, self.ledger.store_prefix(epoch))

    def known(self, epoch: int) -> dict[str, KeyValue] | None:
        """The keys of ``epoch``'s store as its watch holds them, or None while the watch is
        not on that epoch (then read etcd)."""
        snap = self.changes.snapshot(_EPOCH_WATCH, self.ledger.store_prefix(epoch))
        return snap.items if snap is not None else None

    def wait_written(self, store: EtcdStore, keys: Sequence[str], epoch: int, stage: str, *,
                     timeout_s: float | None = None, follow_epoch: bool = True) -> bool:
        """Wait until every one of ``keys`` is in ``store`` (woken by the epoch watch, not
        a timer). Gives up as soon as a newer epoch exists (``follow_epoch``: a participant
        that moved on never writes its key here) or the member closes (``AttemptAborted``);
        after ``timeout_s`` (default the epoch deadline) raises ``RefitError`` naming
        ``stage``, or returns False when ``follow_epoch`` is off."""
        timeout_s = self.config.timeouts.epoch_deadline_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            changed = self.changes.token()  # a key written after this wakes the wait below
            known = self.known(epoch) if store.epoch == epoch else None
            if self.ledger.written(store, keys, known):
                return True
            if follow_epoch and self.superseded(epoch):
                raise AttemptAborted(f"epoch {epoch} was superseded by epoch {self.membership.view.epoch} "
                                     f"before {stage}")
            if self.stop.is_set():
                raise AttemptAborted(f"closing before {stage}")
            left = deadline - time.monotonic()
            if left <= 0:
                if not follow_epoch:
                    return False
                raise RefitError(f"{stage} did not happen within {timeout_s} s")
            # The watches resume and relist on their own: the bound only caps what a lost
            # event could cost.
            self.changes.wait_after(changed, min(self.config.timeouts.idle_wake_s, left))
