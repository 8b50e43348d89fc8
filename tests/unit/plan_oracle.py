"""Independent checks of a plan, written without the planner's machinery.

- ``brute_force_lower_bound``: DESIGN.md invariant 2 computed on dense boolean masks.
- ``write_counts``: how many times each destination element is written.
- ``assert_plan_correct``: executes the plan in-process and checks every destination byte,
  untouched padding, exactly-once writes, the bound, buckets and the round schedule.
"""

from __future__ import annotations

import numpy as np

from elastic_refit.layout import Layout, Topology
from elastic_refit.plan import Plan, TransferKind
from elastic_refit.transport.inprocess import (
    allocate_buffers,
    check_pieces,
    copy_regions,
    execute_in_process,
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


def assert_plan_correct(plan: Plan, seed: int = 0) -> None:
    src, dst, topo = plan.source, plan.destination, plan.topology
    tensors = random_tensors(src, seed)
    src_buffers = allocate_buffers(src)
    scatter_tensors(src, tensors, src_buffers)
    dst_buffers = allocate_buffers(dst, fill=SENTINEL)
    execute_in_process(plan, src_buffers, dst_buffers)
    problems = check_pieces(dst, tensors, dst_buffers)
    assert not problems, f"wrong destination pieces: {problems[:3]}"

    # Exactly once inside pieces, never outside (padding untouched).
    counts = write_counts(plan)
    covered = {key: np.zeros(c.shape, dtype=bool) for key, c in counts.items()}
    for p in range(dst.num_pieces):
        key, _, local = piece_slices(dst, p)
        covered[key][local] = True
    for key, c in counts.items():
        assert np.all(c[covered[key]] == 1), f"buffer {key}: elements written {np.unique(c[covered[key]])} times"
        assert np.all(c[~covered[key]] == 0), f"buffer {key}: padding written"
        sentinel = np.full(1, SENTINEL, dtype=dst_buffers[key].dtype)[0]
        assert np.all(dst_buffers[key][~covered[key]] == sentinel), f"buffer {key}: padding changed"

    bound = brute_force_lower_bound(src, dst, topo)
    assert plan.stats.lower_bound_bytes == bound
    assert plan.stats.cross_domain_bytes == bound

    t = plan.transfers
    domains = topo.domain_array()
    net = t.kind == int(TransferKind.NETWORK)
    assert np.all(domains[t.src_rank[net]] != domains[t.dst_rank[net]])
    assert np.all(domains[t.src_rank[~net]] == domains[t.dst_rank[~net]])
    local = t.kind == int(TransferKind.LOCAL)
    assert np.all(t.src_rank[local] == t.dst_rank[local])
    assert np.all(t.src_rank[~local] != t.dst_rank[~local])

    # Buckets hold whole boxes within the budget.
    x = plan.expand()
    _, in_bucket = plan.options.bucket_of(x.message_offset)
    assert np.all(in_bucket + t.nbytes[x.row] <= plan.options.bucket_bytes)
    assert np.all(t.nbytes <= plan.options.max_transfer_bytes)
    # In one (phase, round) a rank sends to one peer and receives from one peer.
    for phase in np.unique(t.phase):
        for rnd in np.unique(t.round[(t.phase == phase) & ~local]):
            sel = (t.phase == phase) & (t.round == rnd) & ~local
            pairs = np.unique(np.column_stack([t.src_rank[sel], t.dst_rank[sel]]), axis=0)
            assert np.unique(pairs[:, 0]).size == pairs.shape[0], "a rank sends to two peers in one round"
            assert np.unique(pairs[:, 1]).size == pairs.shape[0], "a rank receives from two peers in one round"
