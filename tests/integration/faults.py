"""Faults for multi-process executor tests: picklable programs of a ``FaultyTransport``,
applied in the child to its own transport."""

from __future__ import annotations

from dataclasses import dataclass

from elastic_refit.testing.faults import FaultyTransport, injected_failure, kill_self


@dataclass(frozen=True)
class FailAfterSends:
    """On rank ``rank``, the send after ``after`` sends fails as a broken link
    (``mode="raise"``) or the process SIGKILLs itself (``mode="kill"``) mid-transfer."""

    rank: int
    after: int
    mode: str = "raise"

    def __call__(self, transport: FaultyTransport) -> None:
        if transport.rank != self.rank:
            return
        action = kill_self if self.mode == "kill" else injected_failure(
            f"failure on rank {self.rank} after {self.after} sends")
        transport.inject(action, after=self.after, op="send")


@dataclass(frozen=True)
class CorruptFirstSend:
    """On rank ``rank``, the first send carries one flipped byte (as a faulty link or kernel
    would), so the receiver's digest check must catch it."""

    rank: int

    def __call__(self, transport: FaultyTransport) -> None:
        if transport.rank == self.rank:
            transport.corrupt_sends(1)
