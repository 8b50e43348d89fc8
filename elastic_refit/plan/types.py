"""Frozen plan data: options, the transfer table, figures, per-rank views."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from elastic_refit.layout import Layout, Topology

MiB = 1 << 20


class TransferKind(IntEnum):
    """Where a transfer's bytes travel."""

    LOCAL = 0  # source and destination buffers on the same rank
    INTRA = 1  # between two ranks of one domain (NVLink)
    NETWORK = 2  # across domains (NIC)


class Phase(IntEnum):
    """Phases run in order; a fan-out copies bytes that arrived in the network phase."""

    DELIVER = 0  # network transfers, and intra/local copies from source pieces
    FAN_OUT = 1  # intra-domain copies from the receiver's destination buffer


class SourceSide(IntEnum):
    SOURCE = 0  # read from a piece of the source layout
    DESTINATION = 1  # read from a piece of the destination layout (fan-out)


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """Knobs that change the plan (and so its fingerprint).

    ``bucket_bytes`` bounds one packed buffer; a transfer larger than half of it is split
    so that every bucket holds whole boxes and stays within the bound.
    """

    bucket_bytes: int = 64 * MiB

    def __post_init__(self) -> None:
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 2:
            raise ValueError(f"bucket_bytes must be an integer >= 2, got {self.bucket_bytes!r}")

    @property
    def max_transfer_bytes(self) -> int:
        return self.bucket_bytes // 2


def _readonly(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array)
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class TransferTable:
    """One row per box copy, column-wise. Sorted by (phase, round, src, dst, tensor, box).

    ``src_piece`` indexes the source layout's pieces when ``src_side`` is SOURCE and the
    destination layout's pieces when it is DESTINATION (a fan-out); ``dst_piece`` always
    indexes the destination layout. ``offsets``/``lengths`` are the global box (padded to
    the plan's ndim). ``message`` numbers (phase, src rank, dst rank) groups; ``bucket`` and
    ``bucket_offset`` place the box inside the packed buffers of its message.
    """

    kind: np.ndarray
    phase: np.ndarray
    round: np.ndarray
    message: np.ndarray
    bucket: np.ndarray
    bucket_offset: np.ndarray
    tensor: np.ndarray
    src_side: np.ndarray
    src_piece: np.ndarray
    dst_piece: np.ndarray
    src_rank: np.ndarray
    dst_rank: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    nbytes: np.ndarray

    def __post_init__(self) -> None:
        n = self.kind.shape[0]
        for name in self.__dataclass_fields__:
            array = _readonly(getattr(self, name))
            if array.shape[0] != n:
                raise ValueError(f"transfer column {name!r} has {array.shape[0]} rows, expected {n}")
            object.__setattr__(self, name, array)

    def __len__(self) -> int:
        return int(self.kind.shape[0])

    def columns(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True, slots=True)
class PlanStats:
    """Figures of one plan, all in bytes or counts (the planner reads no clock)."""

    model_bytes: int
    dst_bytes: int
    lower_bound_bytes: int
    cross_domain_bytes: int
    intra_domain_bytes: int
    local_bytes: int
    gather_broadcast_bytes: int
    max_send_bytes: int
    max_recv_bytes: int
    transfers: int
    network_transfers: int
    intra_transfers: int
    local_transfers: int
    messages: int
    rounds: int
    buckets: int
    num_source_ranks: int
    num_destination_ranks: int
    num_domains: int


@dataclass(frozen=True, eq=False)
class Plan:
    """What every rank sends, receives and copies for one (source, destination, topology).

    Pure data: equal inputs give byte-identical tables and the same ``fingerprint`` on
    every process; ranks agree on the fingerprint before any byte moves.
    """

    source: Layout
    destination: Layout
    topology: Topology
    options: PlanOptions
    transfers: TransferTable
    stats: PlanStats
    fingerprint: str
    # Per-rank network/intra byte totals, for the cost model and balance checks.
    network_send_bytes: np.ndarray = field(repr=False)
    network_recv_bytes: np.ndarray = field(repr=False)
    intra_send_bytes: np.ndarray = field(repr=False)
    intra_recv_bytes: np.ndarray = field(repr=False)

    def rows_for(self, rank: int) -> np.ndarray:
        """Indices of every transfer that ``rank`` sends, receives or copies locally."""
        t = self.transfers
        return np.flatnonzero((t.src_rank == rank) | (t.dst_rank == rank))
