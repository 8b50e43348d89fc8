"""Independent checks of a plan, written without the planner's machinery.

- ``brute_force_lower_bound``: DESIGN.md invariant 2 computed on dense boolean masks.
- ``write_counts``: how many times each destination element is written.
- ``assert_plan_correct``: executes the plan in-process and checks every destination byte,
  untouched padding, exactly-once writes, the bound, buckets, the round schedule and every
  figure of ``PlanStats`` (``assert_stats_match``); for relayed plans also the forwards and
  the ingress balance (``assert_relay_rows``).
- ``rebuilt`` and ``assert_same_plan``: a layout with none of the facts a layout memoises or
  inherits from the one it was derived from, and plan equality down to every column.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from elastic_refit.layout import Layout, Topology
from elastic_refit.plan import Plan, SourceSide, TransferKind
from elastic_refit.testing.inprocess import (
    allocate_buffers,
    check_pieces,
    copy_regions,
    execute_in_process,
    forward_sources,
    piece_slices,
    scatter_tensors,
    storage_dtype,
)

SENTINEL = 0xA5


def brute_force_lower_bound(source: Layout, destination: Layout, topology: Topology) -> int:
    total = 0
    domains = topology.domain_array()
    for t in destination.tensors:
        per_domain: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for side, layout in ((0, source), (1, destination)):
            for p in layout.pieces(t.name):
                d = int(domains[p.rank])
                masks = per_domain.setdefault(d, (np.zeros(t.shape, bool), np.zeros(t.shape, bool)))
                masks[side][p.box.slices()] = True
        for src_mask, dst_mask in per_domain.values():
            total += int(np.count_nonzero(dst_mask & ~src_mask)) * t.itemsize
    return total


def random_tensors(layout: Layout, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for t in layout.tensors:
        dtype = storage_dtype(t.dtype)
        out[t.name] = rng.integers(0, np.iinfo(dtype).max, size=t.shape, dtype=dtype, endpoint=True)
    return out


def write_counts(plan: Plan) -> dict[tuple[int, str], np.ndarray]:
    dst = plan.destination
    counts = {key: np.zeros(buf.shape, dtype=np.int64) for key, buf in allocate_buffers(dst).items()}
    if len(plan.transfers) == 0:
        return counts
    x, _, _, dst_off, dst_len = copy_regions(plan)
    for i in range(x.row.size):
        key, _, _ = piece_slices(dst, int(x.dst_piece[i]))
        nd = counts[key].ndim
        sl = tuple(slice(int(o), int(o + n)) for o, n in zip(dst_off[i, :nd], dst_len[i, :nd], strict=True))
        counts[key][sl] += 1
    return counts


def assert_written_once(dst: Layout, counts: dict[tuple[int, str], np.ndarray],
                        dst_buffers: dict[tuple[int, str], np.ndarray]) -> None:
    """Every element inside a destination piece written exactly once (``counts``), never one
    outside (padding untouched: still the sentinel)."""
    covered = {key: np.zeros(c.shape, dtype=bool) for key, c in counts.items()}
    for p in range(dst.num_pieces):
        key, _, local = piece_slices(dst, p)
        covered[key][local] = True
    for key, c in counts.items():
        assert np.all(c[covered[key]] == 1), f"buffer {key}: elements written {np.unique(c[covered[key]])} times"
        assert np.all(c[~covered[key]] == 0), f"buffer {key}: padding written"
        sentinel = np.full(1, SENTINEL, dtype=dst_buffers[key].dtype)[0]
        assert np.all(dst_buffers[key][~covered[key]] == sentinel), f"buffer {key}: padding changed"


def assert_network_rows_cross_domains(plan: Plan) -> None:
    """Network rows go between domains, every other row stays inside one."""
    t = plan.transfers
    domains = plan.topology.domain_array()
    net = t.kind == int(TransferKind.NETWORK)
    assert np.all(domains[t.src_rank[net]] != domains[t.dst_rank[net]])
    assert np.all(domains[t.src_rank[~net]] == domains[t.dst_rank[~net]])


def assert_plan_correct(plan: Plan, seed: int = 0) -> None:
    src, dst, topo = plan.source, plan.destination, plan.topology
    tensors = random_tensors(src, seed)
    src_buffers = allocate_buffers(src)
    scatter_tensors(src, tensors, src_buffers)
    dst_buffers = allocate_buffers(dst, fill=SENTINEL)
    execute_in_process(plan, src_buffers, dst_buffers)
    problems = check_pieces(dst, tensors, dst_buffers)
    assert not problems, f"wrong destination pieces: {problems[:3]}"

    assert_written_once(dst, write_counts(plan), dst_buffers)

    bound = brute_force_lower_bound(src, dst, topo)
    assert plan.stats.lower_bound_bytes == bound
    assert plan.stats.cross_domain_bytes == bound

    t = plan.transfers
    assert_network_rows_cross_domains(plan)
    local = t.kind == int(TransferKind.LOCAL)
    assert np.all(t.src_rank[local] == t.dst_rank[local])
    assert np.all(t.src_rank[~local] != t.dst_rank[~local])

    # Buckets hold whole boxes within the budget.
    x = plan.expand()
    _, in_bucket = plan.options.bucket_of(x.message_offset)
    assert np.all(in_bucket + t.nbytes[x.row] <= plan.options.bucket_bytes)
    assert np.all(t.nbytes <= plan.options.max_transfer_bytes)
    # In one (phase, round) a rank sends to one peer and receives from one peer; forwards
    # (relayed plans) travel beside their network message, to and from any rank of the domain.
    forward = t.src_side == int(SourceSide.RELAY)
    scheduled = ~local & ~forward
    for phase in np.unique(t.phase):
        for rnd in np.unique(t.round[(t.phase == phase) & scheduled]):
            sel = (t.phase == phase) & (t.round == rnd) & scheduled
            pairs = np.unique(np.column_stack([t.src_rank[sel], t.dst_rank[sel]]), axis=0)
            assert np.unique(pairs[:, 0]).size == pairs.shape[0], "a rank sends to two peers in one round"
            assert np.unique(pairs[:, 1]).size == pairs.shape[0], "a rank receives from two peers in one round"

    if plan.relayed:
        assert_relay_rows(plan)
    else:
        assert not forward.any() and np.all(t.dst_piece >= 0), "a plan that does not relay forwards or stages"
    assert_stats_match(plan)


def assert_relay_rows(plan: Plan) -> None:
    """What only relayed plans have: forwards instead of fan-outs, as the table's last rows,
    each what its network copy brought (``forward_sources`` checks that); only network copies
    may be staged without a destination piece; and no NIC of a domain receives more than
    the domain's balanced share plus one region."""
    t = plan.transfers
    forward_sources(plan, plan.expand())
    assert not np.any(t.src_side == int(SourceSide.DESTINATION)), "relayed plans forward instead of fanning out"
    forward = t.src_side == int(SourceSide.RELAY)
    if forward.any():
        assert np.all(forward[np.argmax(forward):]), "forwards are the table's last rows"
    assert np.all(t.kind[t.dst_piece < 0] == int(TransferKind.NETWORK)), "only a network copy is staged only"
    assert_ingress_balanced(plan)


def assert_ingress_balanced(plan: Plan) -> None:
    """No NIC of a domain receives more than the domain's balanced share (its network bytes
    over its participating ranks) plus one region (one network row, all its copies)."""
    t = plan.transfers
    domains = plan.topology.domain_array()
    participants = np.union1d(plan.source.buffer_rank, plan.destination.buffer_rank)
    net = np.flatnonzero(t.kind == int(TransferKind.NETWORK))
    weight = t.nbytes[net] * t.instances[net]
    recv = plan.network_recv_bytes
    outside = np.setdiff1d(np.arange(plan.topology.num_ranks), participants)
    assert not recv[outside].any(), "a rank outside the refit receives"
    for domain in np.unique(domains[t.dst_rank[net]]).tolist():
        ranks = participants[domains[participants] == domain]
        into = domains[t.dst_rank[net]] == domain
        total, largest = int(weight[into].sum()), int(weight[into].max())
        assert int(recv[ranks].sum()) == total
        busiest = int(recv[ranks].max())
        assert busiest * ranks.size <= total + largest * ranks.size, (domain, busiest, total / ranks.size, largest)


def brute_force_gather_broadcast_bytes(source: Layout, destination: Layout) -> int:
    """Each tensor gathered whole on the source rank holding most of it (lowest rank on a
    tie), then sent whole to every other destination rank holding part of it."""
    total = 0
    for t in destination.tensors:
        held: dict[int, int] = {}
        for p in source.pieces(t.name):
            held[p.rank] = held.get(p.rank, 0) + int(np.prod(p.box.lengths)) * t.itemsize
        root = min(held, key=lambda r: (-held[r], r)) if held else None
        total += max(t.nbytes - held.get(root, 0), 0)
        total += t.nbytes * len({p.rank for p in destination.pieces(t.name)} - {root})
    return total


def assert_stats_match(plan: Plan) -> None:
    """Every figure of ``plan.stats`` recomputed from the table and the layouts."""
    src, dst, t, s = plan.source, plan.destination, plan.transfers, plan.stats
    domains = plan.topology.domain_array()
    nbytes = np.prod(t.lengths, axis=1) * dst.tensor_itemsize[t.tensor]
    assert np.array_equal(t.nbytes, nbytes)
    assert np.array_equal(t.instances, np.diff(plan.classes.start)[plan.classes.class_of[t.tensor]])
    weight = t.nbytes * t.instances
    by_kind = {k: t.kind == int(k) for k in TransferKind}
    assert s.cross_domain_bytes == int(weight[by_kind[TransferKind.NETWORK]].sum())
    assert s.intra_domain_bytes == int(weight[by_kind[TransferKind.INTRA]].sum())
    assert s.local_bytes == int(weight[by_kind[TransferKind.LOCAL]].sum())
    assert s.num_network_transfers == int(t.instances[by_kind[TransferKind.NETWORK]].sum())
    assert s.num_intra_transfers == int(t.instances[by_kind[TransferKind.INTRA]].sum())
    assert s.num_local_transfers == int(t.instances[by_kind[TransferKind.LOCAL]].sum())
    assert s.num_transfers == int(t.instances.sum()) and s.num_rows == len(t)
    for kind, send, recv in ((TransferKind.NETWORK, plan.network_send_bytes, plan.network_recv_bytes),
                             (TransferKind.INTRA, plan.intra_send_bytes, plan.intra_recv_bytes)):
        want_send = np.zeros(plan.topology.num_ranks, dtype=np.int64)
        want_recv = np.zeros(plan.topology.num_ranks, dtype=np.int64)
        np.add.at(want_send, t.src_rank[by_kind[kind]], weight[by_kind[kind]])
        np.add.at(want_recv, t.dst_rank[by_kind[kind]], weight[by_kind[kind]])
        assert np.array_equal(send, want_send) and np.array_equal(recv, want_recv), kind
    assert s.max_send_bytes == int(plan.network_send_bytes.max(initial=0))
    assert s.max_recv_bytes == int(plan.network_recv_bytes.max(initial=0))
    assert s.model_bytes == sum(x.nbytes for x in dst.tensors)
    assert s.dst_bytes == sum(int(np.prod(p.box.lengths)) * dst.tensor(p.tensor).itemsize for p in dst.pieces())
    assert s.gather_broadcast_bytes == brute_force_gather_broadcast_bytes(src, dst)
    assert s.num_tensor_classes == plan.classes.num_classes
    assert s.num_source_ranks == len(set(src.buffer_rank.tolist()))
    assert s.num_destination_ranks == len(set(dst.buffer_rank.tolist()))
    assert s.num_domains == len({int(domains[r]) for r in src.buffer_rank.tolist() + dst.buffer_rank.tolist()})
    # Messages, rounds and buckets of the peer-to-peer rows.
    peer = ~by_kind[TransferKind.LOCAL]
    assert s.num_rounds == len(set(zip(t.phase[peer].tolist(), t.round[peer].tolist(), strict=True)))
    # A copy lives in the bucket where it starts, so a message's buckets run up to its last start;
    # a forward message (relayed plans) has a part for each network bucket it forwards from.
    half = plan.options.max_transfer_bytes
    messages: dict[int, int] = {}  # message -> start of its last copy
    forward_buckets: dict[int, set[int]] = {}  # forward message -> network buckets it forwards from
    x = plan.expand(np.flatnonzero(peer))
    for row, start in zip(x.row.tolist(), x.message_offset.tolist(), strict=True):
        message = int(t.message[row])
        if t.src_side[row] == int(SourceSide.RELAY):
            forward_buckets.setdefault(message, set()).add(start // half)
        else:
            messages[message] = max(messages.get(message, 0), start)
    assert s.num_messages == len(messages) + len(forward_buckets)
    assert s.num_buckets == (sum(last // half + 1 for last in messages.values())
                             + sum(len(b) for b in forward_buckets.values()))


def rebuilt(layout: Layout) -> Layout:
    """The same layout, constructed from copies of its columns: nothing memoised or inherited
    (what a cold plan in a fresh process starts from)."""
    return Layout(**{f.name: (np.array(getattr(layout, f.name)) if isinstance(getattr(layout, f.name), np.ndarray)
                              else getattr(layout, f.name))
                     for f in dataclasses.fields(Layout) if f.init})


def assert_same_plan(got: Plan, want: Plan) -> None:
    """Equal down to every column (values and dtypes), class, figure and fingerprint."""
    assert got.fingerprint == want.fingerprint
    assert got.source.fingerprint == want.source.fingerprint
    assert got.destination.fingerprint == want.destination.fingerprint
    for name, col in want.transfers.columns().items():
        other = getattr(got.transfers, name)
        assert other.dtype == col.dtype and np.array_equal(other, col), name
    for name in ("representative", "start", "members", "class_of"):
        assert np.array_equal(getattr(got.classes, name), getattr(want.classes, name)), name
    assert got.stats == want.stats
    for name in ("source_tensor", "network_send_bytes", "network_recv_bytes", "intra_send_bytes",
                 "intra_recv_bytes"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
