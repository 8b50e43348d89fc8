"""Frozen plan data: options, the transfer table, figures, per-rank views."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from elastic_refit.layout import Layout, Topology
from elastic_refit.layout.core import readonly_column

__all__ = [
    "RELAY_MODES",
    "ExpandedTransfers",
    "MiB",
    "Phase",
    "Plan",
    "PlanOptions",
    "PlanStats",
    "RankPlan",
    "SourceSide",
    "TensorClasses",
    "TransferKind",
    "TransferTable",
    "Uncovered",
    "relay_mode",
]

MiB = 1 << 20
RELAY_MODES = ("auto", "on", "off")  # PlanOptions.relay


def relay_mode(value: object) -> str:
    """``value`` as one of :data:`RELAY_MODES`; a bool (the option's type before "auto")
    means "on" / "off". ``ValueError`` for anything else."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value not in RELAY_MODES:
        raise ValueError(f"relay must be one of {', '.join(RELAY_MODES)} (or a bool), got {value!r}")
    return str(value)


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
    # Read from the bytes a network row brought into its receiver (``src_piece`` is that
    # row's index): a forward, which the executor pipelines bucket by bucket with its row.
    RELAY = 2


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """Knobs that change the plan (and so its fingerprint).

    ``bucket_bytes`` bounds one packed buffer; a transfer larger than half of it is split
    so that every bucket holds whole boxes and stays within the bound.

    ``concurrent_rounds`` is how many rounds of a phase run at once: in a window of that
    many rounds a rank has every message of the window in flight, one bucket of each at a
    time (one NCCL group per bucket index). One round at a time is the least staging (four
    buckets); more rounds keep several peer links busy at once, which a network whose pairs
    are slower than a rank's NIC (sockets, one queue pair per peer) needs. Every rank must
    use the same windows (a rank waiting in a window its peer has not opened would hang),
    so the count is part of the plan and of its fingerprint.

    ``relay`` is ingress balance: each destination domain's cross-domain regions are
    received by whichever rank of the domain keeps the busiest NIC least loaded (a rank that
    needs none of the region is a relay), and every region is forwarded from the bytes its
    receiver staged, bucket by bucket under the network transfer (``SourceSide.RELAY``
    rows), instead of a fan-out phase after it. ``"on"`` always plans so; ``"off"`` never
    does; ``"auto"`` (the default) relays only when ingress balance lowers the plan's
    busiest NIC (the most network bytes one rank sends or receives, which the predicted time
    follows on every described cluster) and otherwise returns the plain plan, byte for byte
    and fingerprint for fingerprint. ``True`` and ``False`` are accepted for ``"on"`` and
    ``"off"``. ``Plan.relayed`` says what the planner chose.
    """

    bucket_bytes: int = 64 * MiB
    # Runs contiguous on both sides and at least this large travel straight from the
    # source buffer into the destination buffer, without packing (part of the plan, so
    # both ends of a message agree).
    direct_min_bytes: int = 256 * 1024
    concurrent_rounds: int = 1
    relay: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 2:
            raise ValueError(f"bucket_bytes must be an integer >= 2, got {self.bucket_bytes!r}")
        if not isinstance(self.direct_min_bytes, int) or self.direct_min_bytes < 1:
            raise ValueError(f"direct_min_bytes must be an integer >= 1, got {self.direct_min_bytes!r}")
        if not isinstance(self.concurrent_rounds, int) or isinstance(self.concurrent_rounds, bool) \
                or self.concurrent_rounds < 1:
            raise ValueError(f"concurrent_rounds must be an integer >= 1, got {self.concurrent_rounds!r}")
        object.__setattr__(self, "relay", relay_mode(self.relay))

    @property
    def max_transfer_bytes(self) -> int:
        return self.bucket_bytes // 2

    def bucket_of(self, message_offset: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(bucket index, offset inside the bucket) of copies at these message offsets."""
        return np.divmod(message_offset, self.max_transfer_bytes)


@dataclass(frozen=True, eq=False)
class TransferTable:
    """One row per box copy, column-wise, in the planner's (deterministic) generation order.

    A row is planned for the representative ``tensor`` of a class of identically laid-out
    tensors and stands for ``instances`` box copies, one per class member (see
    ``TensorClasses``); ``nbytes`` is the size of one of them. ``src_piece`` indexes the
    source layout's pieces when ``src_side`` is SOURCE and the destination layout's pieces
    when it is DESTINATION (a fan-out); ``dst_piece`` always indexes the destination layout.
    ``offsets``/``lengths`` are the global box (padded to the plan's ndim). ``message``
    numbers (phase, round, src rank, dst rank) groups. ``message_offset`` is where the row's
    first copy starts in its message's byte stream; the other copies follow it. The stream
    is cut into buckets of half a bucket budget: a copy starting at byte ``p`` lives in bucket
    ``p // (bucket_bytes // 2)`` at ``p % (bucket_bytes // 2)``, and since no box exceeds
    half a budget, no bucket exceeds ``bucket_bytes``.

    Relayed plans (``PlanOptions.relay``) add two kinds of rows. A network row whose
    ``dst_piece`` is -1 lands in its receiver's staging only (the receiver needs none of it).
    A forward row (``src_side`` RELAY, always the last rows of the table) copies what network
    row ``src_piece`` brought to ``src_rank`` into a destination piece of another rank of the
    domain; it has that row's ``round`` and ``message_offset`` (its copies travel with the
    bucket their network copy arrived in), and messages of its own.
    """

    kind: np.ndarray
    phase: np.ndarray
    round: np.ndarray
    message: np.ndarray
    message_offset: np.ndarray
    tensor: np.ndarray
    src_side: np.ndarray
    src_piece: np.ndarray
    dst_piece: np.ndarray
    src_rank: np.ndarray
    dst_rank: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    nbytes: np.ndarray
    instances: np.ndarray

    def __post_init__(self) -> None:
        num_rows = self.kind.shape[0]
        for name in self.__dataclass_fields__:
            array = readonly_column(getattr(self, name))
            if array.shape[0] != num_rows:
                raise ValueError(f"transfer column {name!r} has {array.shape[0]} rows, expected {num_rows}")
            object.__setattr__(self, name, array)

    def __len__(self) -> int:
        return int(self.kind.shape[0])

    def columns(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True, eq=False)
class TensorClasses:
    """Destination tensors grouped by identical layouts (same shape, dtype, and the same
    ranks and boxes on both sides). The planner plans one representative per class; a
    row of the plan applies to every member, whose pieces line up one to one with the
    representative's (pieces are sorted by tensor, rank and box)."""

    representative: np.ndarray  # [C] destination tensor id planned for each class
    start: np.ndarray  # [C + 1] offsets into members
    members: np.ndarray  # [M] destination tensor ids, grouped by class, representative first
    class_of: np.ndarray  # [T] class of every destination tensor

    def __post_init__(self) -> None:
        for name in ("representative", "start", "members", "class_of"):
            object.__setattr__(self, name, readonly_column(np.asarray(getattr(self, name), dtype=np.int64)))

    @property
    def num_classes(self) -> int:
        return int(self.representative.shape[0])

    def members_of_representative(self, tensor: int) -> np.ndarray:
        tensor_class = int(self.class_of[tensor])
        return self.members[self.start[tensor_class] : self.start[tensor_class + 1]]


@dataclass(frozen=True, slots=True)
class PlanStats:
    """Figures of one plan, all in bytes (``*_bytes``) or counts (``num_*``); the planner
    reads no clock. ``num_transfers`` counts box copies (a row stands for one copy per
    member of its tensor class), ``num_rows`` the rows of the transfer table."""

    model_bytes: int
    dst_bytes: int
    lower_bound_bytes: int
    cross_domain_bytes: int
    intra_domain_bytes: int
    local_bytes: int
    gather_broadcast_bytes: int
    max_send_bytes: int
    max_recv_bytes: int
    num_transfers: int
    num_rows: int
    num_tensor_classes: int
    num_network_transfers: int
    num_intra_transfers: int
    num_local_transfers: int
    num_messages: int
    num_rounds: int
    num_buckets: int
    num_source_ranks: int
    num_destination_ranks: int
    num_domains: int


@dataclass(frozen=True, slots=True)
class ExpandedTransfers:
    """Box copies of some plan rows, one per class member (see ``Plan.expand``)."""

    row: np.ndarray  # plan row each copy comes from
    tensor: np.ndarray  # destination tensor id of the member
    src_piece: np.ndarray  # piece of the member, on the row's source side
    dst_piece: np.ndarray  # destination piece of the member
    message_offset: np.ndarray  # byte offset of this copy in its message's stream


class _ClassRows:
    """Expansion of plan rows into box copies, shared by ``Plan`` and ``RankPlan`` (both hold
    ``source``, ``destination``, ``transfers``, ``classes`` and ``source_tensor``)."""

    def _index_pieces(self) -> None:
        object.__setattr__(self, "source_tensor", readonly_column(np.asarray(self.source_tensor, dtype=np.int64)))
        # First piece of every tensor, per side (layouts sort pieces by tensor first).
        for side, layout in (("_src_piece_start", self.source), ("_dst_piece_start", self.destination)):
            starts = np.searchsorted(layout.piece_tensor, np.arange(len(layout.tensors) + 1))
            object.__setattr__(self, side, readonly_column(starts.astype(np.int64)))

    def expand(self, rows: np.ndarray | None = None) -> ExpandedTransfers:
        """Every box copy of ``rows`` (default: all), one per member of the row's class."""
        transfers = self.transfers
        rows = np.arange(len(transfers), dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
        copies = transfers.instances[rows]
        row = np.repeat(rows, copies)
        # Which member of its row's class each copy is (0: the representative).
        member_index = np.arange(row.size, dtype=np.int64) - np.repeat(np.cumsum(copies) - copies, copies)
        representative = transfers.tensor[row]
        tensor_class = self.classes.class_of[representative]
        member = self.classes.members[self.classes.start[tensor_class] + member_index]
        dst_start = self._dst_piece_start  # type: ignore[attr-defined]
        src_start = self._src_piece_start  # type: ignore[attr-defined]
        row_dst_piece = transfers.dst_piece[row]
        # -1: a relayed copy, staged by its receiver only
        dst_piece = np.where(row_dst_piece < 0, -1,
                             row_dst_piece - dst_start[representative] + dst_start[member])
        side = transfers.src_side[row]
        src_piece = np.where(
            side == int(SourceSide.DESTINATION),
            transfers.src_piece[row] - dst_start[representative] + dst_start[member],
            transfers.src_piece[row] - src_start[self.source_tensor[representative]]
            + src_start[self.source_tensor[member]],
        )
        relayed = side == int(SourceSide.RELAY)
        if relayed.any():  # a forward's source is its network row (copied member by member)
            src_piece[relayed] = transfers.src_piece[row[relayed]]
        message_offset = transfers.message_offset[row] + member_index * transfers.nbytes[row]
        return ExpandedTransfers(row, member, src_piece, dst_piece, message_offset)


@dataclass(frozen=True, eq=False)
class Plan(_ClassRows):
    """What every rank sends, receives and copies for one (source, destination, topology).

    Pure data: equal inputs give byte-identical tables and the same ``fingerprint`` on
    every process; ranks agree on the fingerprint before any byte moves.
    """

    source: Layout
    destination: Layout
    topology: Topology
    options: PlanOptions
    transfers: TransferTable
    classes: TensorClasses
    source_tensor: np.ndarray = field(repr=False)  # [T] source tensor id of each destination tensor
    stats: PlanStats = field(repr=False)
    fingerprint: str = field()
    # Per-rank network/intra byte totals, for the cost model and balance checks.
    network_send_bytes: np.ndarray = field(repr=False)
    network_recv_bytes: np.ndarray = field(repr=False)
    intra_send_bytes: np.ndarray = field(repr=False)
    intra_recv_bytes: np.ndarray = field(repr=False)
    # The source domains whose NICs must carry the most cross-domain bytes per NIC: bytes
    # that only these domains hold, and the ranks of these domains (for the cost bound).
    egress_group_bytes: int = field(default=0, repr=False)
    egress_group_ranks: int = field(default=1, repr=False)
    # Whether the plan balances ingress and forwards (PlanOptions.relay "on", or "auto" where
    # that lowered the busiest NIC); part of the fingerprint.
    relayed: bool = field(default=False)
    # Plans in a quantized destination format (``make_plan(..., formats=...)``): the formats,
    # the caller's layouts and the partial-amax exchange (``elastic_refit.plan.quantized``);
    # ``source`` and ``destination`` are then the layouts in the destination format. None
    # when nothing is quantized.
    quantization: object = field(default=None, repr=False)
    # Plans that cast (``layout.casts``): the source layout as given and the casts
    # (``SourceCast``); ``source`` is then that layout in the destination dtypes. None when
    # every dtype matches.
    cast: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._index_pieces()

    def rows_for(self, rank: int) -> np.ndarray:
        """Indices of every transfer that ``rank`` sends, receives or copies locally."""
        transfers = self.transfers
        return np.flatnonzero((transfers.src_rank == rank) | (transfers.dst_rank == rank))


@dataclass(frozen=True, eq=False)
class RankPlan(_ClassRows):
    """One rank's view of a plan: the rows it sends, receives or copies locally, as the full
    plan has them (same columns, same generation order, same rounds and stream offsets), for
    ``build_rank_schedule(rank_plan, rank)``.

    ``message`` numbers this rank's messages only (in (phase, round, src, dst) order, as the
    full plan numbers all of them). ``fingerprint`` is the fingerprint of the plan's inputs
    (``plan_input_fingerprint``): a rank cannot hash rows it never built, so the ranks agree
    on the inputs, which determine every row. ``num_rounds`` is the plan's round space, empty
    rounds included (every rank walks the same rounds; a rank cannot know which are empty
    elsewhere), at least the full plan's ``PlanStats.num_rounds``, which counts the rounds
    that hold a message.
    """

    rank: int
    source: Layout
    destination: Layout
    topology: Topology
    options: PlanOptions
    transfers: TransferTable
    classes: TensorClasses
    source_tensor: np.ndarray = field(repr=False)  # [T] source tensor id of each destination tensor
    fingerprint: str = field()
    num_rounds: int = 0
    relayed: bool = False
    cast: object = field(default=None, repr=False)  # as Plan.cast

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.topology.num_ranks:
            raise ValueError(f"rank must be in [0, {self.topology.num_ranks}), got {self.rank!r}")
        t = self.transfers
        if len(t) and not bool(np.all((t.src_rank == self.rank) | (t.dst_rank == self.rank))):
            raise ValueError(f"a RankPlan of rank {self.rank} holds rows that rank neither sends nor receives")
        self._index_pieces()

    def rows_for(self, rank: int) -> np.ndarray:
        """Every row (all of them are ``rank``'s); ``ValueError`` for another rank."""
        if rank != self.rank:
            raise ValueError(f"this plan is rank {self.rank}'s view; rank {rank} has to plan its own")
        return np.arange(len(self.transfers), dtype=np.int64)

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes this rank sends and receives, per kind (``network_send``, ``network_recv``,
        ``intra_send``, ``intra_recv``, ``local``), every class member counted."""
        t = self.transfers
        weight = t.nbytes * t.instances
        sends, recvs = t.src_rank == self.rank, t.dst_rank == self.rank
        out = {}
        for kind, name in ((TransferKind.NETWORK, "network"), (TransferKind.INTRA, "intra")):
            of_kind = t.kind == int(kind)
            out[f"{name}_send"] = int(weight[of_kind & sends].sum())
            out[f"{name}_recv"] = int(weight[of_kind & recvs].sum())
        out["local"] = int(weight[t.kind == int(TransferKind.LOCAL)].sum())
        return out


class Uncovered(ValueError):
    """A destination region no source piece covers, or a quantized tensor whose sources lack
    some of its blocks: the sources named lack it (a member holding it is gone or not there yet). Unlike the planner's other ``ValueError`` (shapes,
    dtypes, tensors one side lacks, overlaps, a bucket too small) it may pass once the
    members change."""
