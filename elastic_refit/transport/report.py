"""What a refit reports: :class:`TransferReport` (bytes, counts, seconds of one rank's
refit) and :class:`Phases` (where its seconds went, carried by ``transport.executor.done``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["Phases", "TransferReport"]


@dataclass(frozen=True, slots=True)
class TransferReport:
    """What one rank moved in one refit: bytes (``*_bytes``), counts (``num_*``) and the
    wall time (``seconds``). ``num_buckets`` counts buckets sent and received,
    ``num_zero_copy_buckets`` those of them that went straight from or into a parameter,
    ``num_verified_boxes`` the received boxes whose digest was checked. With deltas:
    ``num_delta_buckets`` this rank sent as their change against the base, and the bytes
    that saved on its network and intra-domain sends (``*_saved_bytes``; what went on the
    wire is ``*_send_bytes`` less them)."""

    rank: int
    seconds: float
    network_send_bytes: int
    network_recv_bytes: int
    intra_send_bytes: int
    intra_recv_bytes: int
    local_bytes: int
    num_buckets: int
    num_zero_copy_buckets: int
    staging_bytes: int
    num_verified_boxes: int
    num_delta_buckets: int = 0
    network_saved_bytes: int = 0
    intra_saved_bytes: int = 0
    direct_recv_bytes: int = 0  # of the received bytes, those read straight from a peer's memory (IPC)


class Phases:
    """Seconds between marks of one refit (prepare, direct reads, exchange, sync, vote):
    the breakdown its ``transport.executor.done`` event carries."""

    __slots__ = ("_last", "seconds")

    def __init__(self, start: float) -> None:
        self._last = start
        self.seconds: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now
