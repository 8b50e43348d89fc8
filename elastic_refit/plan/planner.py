"""The planner: a pure function (source, destination, topology, options) -> Plan.

The algorithm is a handful of relational joins over column arrays, so a 256 + 256 rank
DeepSeek-V3 plan (~700k transfers) is built without a per-transfer Python loop:

1. *Regions*: per side and tensor, the distinct piece boxes, which must be pairwise
   disjoint (always true for DTensor-style and preset layouts). Sides whose boxes
   overlap partially are refined into elementary cells, so any piece list is planned.
2. *Atoms*: non-empty intersections of a source region and a destination region of the
   same tensor. Atoms are disjoint and tile every destination region (else: an error).
3. *Demands*: (atom, destination domain) pairs for every domain with a rank that needs
   the atom. A demand that some source rank inside the domain holds is served inside
   the domain (local copy when the same rank holds it); every other demand crosses the
   network exactly once, into one receiver, then fans out inside the domain. So
   cross-domain bytes equal the lower bound by construction (invariant 2).
4. *Senders* among replicas are chosen greedily, replica group by replica group, to
   keep the busiest NIC as idle as possible (invariant 3).
5. *Schedule*: per phase, transfers between the same (src, dst) form a message; message
   rounds follow a shift schedule, so in a round every rank sends to at most one peer
   and receives from at most one peer. Boxes larger than half a bucket are split;
   buckets hold whole boxes and never exceed ``bucket_bytes``.

Everything is planned once per *tensor class* (tensors laid out alike on both sides), and
regions once per layout of one side. Sorts are one SIMD sort of packed int64 keys with the
row index in the low bits. A re-plan after ranks leave costs what a cold plan costs minus
what the derived layouts inherit (see ``Layout.without_ranks``): the planner keeps no state.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from elastic_refit.layout import Box, Layout, Topology
from elastic_refit.layout.digest import update_int_arrays
from elastic_refit.plan.types import (
    Phase,
    Plan,
    PlanOptions,
    PlanStats,
    SourceSide,
    TensorClasses,
    TransferKind,
    TransferTable,
)

PLANNER_VERSION = "2"  # 2: fingerprints hash columns in their narrowest dtypes


# --------------------------------------------------------------------------------------
# small vectorised helpers
# --------------------------------------------------------------------------------------
def _stable_sort(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.argsort(key, kind="stable")`` and the sorted keys, for a non-negative int64 key.

    With the row index in the low bits every value is distinct, so a plain (SIMD, unstable)
    sort of one int64 array gives the stable order, ~10x faster than a stable argsort.
    """
    n = key.size
    shift = max(n - 1, 1).bit_length()
    if n == 0 or int(key.max()).bit_length() + shift > 63:
        order = np.argsort(key, kind="stable")
        return order, key[order]
    packed = key << shift
    packed |= np.arange(n, dtype=np.int64)
    packed.sort()
    order = packed & ((1 << shift) - 1)
    packed >>= shift
    return order, packed


def _stable_order(key: np.ndarray) -> np.ndarray:
    """``np.argsort(key, kind="stable")`` for a non-negative int64 key (see ``_stable_sort``)."""
    return _stable_sort(key)[0]


def _pack(columns: list[np.ndarray], reserve: int) -> list[np.ndarray]:
    """Int columns packed into few non-negative int64 words that order rows like the
    columns do (``columns[0]`` most significant), leaving ``reserve`` low bits free."""
    words: list[np.ndarray] = []
    word, used = None, 0
    for col in columns:
        lo, hi = int(col.min()), int(col.max())
        bits = (hi - lo).bit_length()
        value = col - lo
        if word is not None and used + bits <= 63 - reserve:
            word, used = (word << bits) | value, used + bits
        else:
            if word is not None:
                words.append(word)
            word, used = value, bits
    words.append(word)
    return words


def _lexsort_words(words: list[np.ndarray]) -> np.ndarray:
    """Stable lexicographic order of rows given as packed words (least significant last):
    one stable sort per word, least significant first."""
    order = _stable_order(words[-1])
    for w in reversed(words[:-1]):
        order = order[_stable_order(w[order])]
    return order


def _lexsort(columns: list[np.ndarray]) -> np.ndarray:
    """``np.lexsort(columns[::-1])``: the stable order of rows, ``columns[0]`` most significant."""
    n = columns[0].shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    return _lexsort_words(_pack(columns, max(n - 1, 1).bit_length()))


def _order_or_none(columns: list[np.ndarray], sizes: list[int]) -> np.ndarray | None:
    """``_lexsort(columns)``, or None when the rows are in that order already (generation
    order often is: checking costs a fraction of sorting). ``columns[i]`` holds values in
    ``[0, sizes[i])``, which packs them without scanning for their range."""
    n = columns[0].shape[0]
    if n < 2:
        return None
    if math.prod(sizes).bit_length() > 63:
        return _lexsort(columns)
    word = columns[0].copy()
    for col, size in zip(columns[1:], sizes[1:], strict=True):
        word *= size
        word += col
    if bool(np.all(word[1:] >= word[:-1])):
        return None
    return _stable_order(word)


def _lexsort_rows(mat: np.ndarray) -> np.ndarray:
    """Indices that sort the rows of ``mat`` lexicographically (column 0 most significant)."""
    return _lexsort([mat[:, j] for j in range(mat.shape[1])])


def _group_rows(columns: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of int columns grouped by value: ``order`` sorts them lexicographically (stable,
    ``columns[0]`` most significant) and ``new`` marks, in that order, the first row of
    every distinct value."""
    n = columns[0].shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    words = _pack(columns, max(n - 1, 1).bit_length())
    order = _lexsort_words(words)
    new = np.zeros(n, dtype=bool)
    new[0] = True
    for w in words:  # the words encode a row exactly, so rows differ where a word does
        sorted_w = w[order]
        new[1:] |= sorted_w[1:] != sorted_w[:-1]
    return order, new


def _volume(lengths: np.ndarray) -> np.ndarray:
    """Elements of each box: ``np.prod(lengths, axis=1)``, one multiply per dim (~8x faster)."""
    out = lengths[:, 0].copy()
    for j in range(1, lengths.shape[1]):
        out *= lengths[:, j]
    return out


def _sorted_unique(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_inverse=True)`` for keys already in ascending order."""
    new = np.ones(keys.size, dtype=bool)
    new[1:] = keys[1:] != keys[:-1]
    return keys[new], np.cumsum(new) - 1


def _group_bounds(sorted_keys: np.ndarray, num_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Start and count of each group id 0..num_groups-1 in an ascending key array."""
    starts = np.searchsorted(sorted_keys, np.arange(num_groups), side="left")
    ends = np.searchsorted(sorted_keys, np.arange(num_groups), side="right")
    return starts, ends - starts


def _expand(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For groups (start, count): (owner index of each expanded row, the row's position)."""
    total = int(counts.sum())
    owner = np.repeat(np.arange(counts.size), counts)
    position = np.arange(total) + np.repeat(starts - (np.cumsum(counts) - counts), counts)
    return owner, position


# --------------------------------------------------------------------------------------
# regions: disjoint boxes per side and tensor, with the pieces that contain them
# --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Regions:
    tensor: np.ndarray  # [R]
    offsets: np.ndarray  # [R, K]
    lengths: np.ndarray  # [R, K]
    inc_start: np.ndarray  # [R] first incidence row of each region
    inc_count: np.ndarray  # [R] pieces containing each region
    inc_piece: np.ndarray  # [I] incidence rows sorted by region


def _pad(array: np.ndarray, k: int, fill: int) -> np.ndarray:
    if array.shape[1] == k:
        return array
    out = np.full((array.shape[0], k), fill, dtype=np.int64)
    out[:, : array.shape[1]] = array
    return out


def _regions(tensor: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> _Regions:
    n = tensor.size
    # contiguous columns: packing strided ones is several times slower
    order, new = _group_rows([tensor, *np.ascontiguousarray(offsets.T), *np.ascontiguousarray(lengths.T)])
    first = order[new]
    r_tensor, r_off, r_len = tensor[first], offsets[first], lengths[first]

    bad = _tensors_with_partial_overlap(r_tensor, r_off, r_len)
    if bad.size:
        inc_region = np.empty(n, dtype=np.int64)
        inc_region[order] = np.cumsum(new) - 1
        r_tensor, r_off, r_len, inc_region, inc_piece = _refine(
            bad, tensor, offsets, lengths, r_tensor, r_off, r_len, inc_region, np.arange(n, dtype=np.int64)
        )
        # Refined cells were appended: restore the (tensor, box) order the joins rely on.
        order = _lexsort_rows(np.column_stack([r_tensor, r_off, r_len]))
        rank_of = np.empty_like(order)
        rank_of[order] = np.arange(order.size)
        r_tensor, r_off, r_len = r_tensor[order], r_off[order], r_len[order]
        inc_region = rank_of[inc_region]
        order = _stable_order(inc_region)
        inc_region, inc_piece = inc_region[order], inc_piece[order]
        starts, counts = _group_bounds(inc_region, r_tensor.size)
    else:
        # The grouping order already lists every region's pieces, in piece order.
        inc_piece = order
        starts = np.flatnonzero(new)
        counts = np.diff(np.append(starts, n))
    return _Regions(r_tensor, r_off, r_len, starts, counts, inc_piece)


def _layout_regions(layout: Layout, rows: np.ndarray, tensor: np.ndarray, k: int) -> _Regions:
    """``_regions`` of the pieces ``rows`` of ``layout`` (whole tensors, in layout order),
    with ``tensor`` the planner's id of each row's tensor.

    Tensors laid out alike (``Layout.tensor_layout_ids``) have the same boxes in the same
    row order, so their regions differ only in tensor id and piece rows: they are found for
    the first tensor of every layout and copied to the others.
    """
    def boxes(at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _pad(layout.piece_offsets[rows[at]], k, 0), _pad(layout.piece_lengths[rows[at]], k, 1)

    own = layout.piece_tensor[rows]
    starts = np.flatnonzero(np.append(True, own[1:] != own[:-1])) if rows.size else rows
    counts = np.diff(np.append(starts, rows.size))
    _, first, inverse = np.unique(layout.tensor_layout_ids()[own[starts]], return_index=True, return_inverse=True)
    if first.size == starts.size:  # nothing to share
        return _regions(tensor, *boxes(np.arange(rows.size)))
    leader = first[inverse]  # per tensor (in row order), the first one laid out alike
    lead = np.sort(first)
    _, lead_rows = _expand(starts[lead], counts[lead])
    base = _regions(tensor[lead_rows], *boxes(lead_rows))
    # Where each leader's rows start among lead_rows, and its block of base regions.
    lead_at = np.zeros(starts.size, dtype=np.int64)
    lead_at[lead] = np.cumsum(counts[lead]) - counts[lead]
    block_start = np.searchsorted(base.tensor, tensor[starts[leader]])
    block_count = np.searchsorted(base.tensor, tensor[starts[leader]], side="right") - block_start
    # Copy blocks in planner tensor order (the order _regions sorts regions in).
    by_id = _stable_order(tensor[starts])
    owner, region = _expand(block_start[by_id], block_count[by_id])
    owner = by_id[owner]
    inc_count = base.inc_count[region]
    inc_owner, inc = _expand(base.inc_start[region], inc_count)
    shift = starts - lead_at[leader]  # row position of a tensor less its leader's among lead_rows
    return _Regions(tensor[starts[owner]], base.offsets[region], base.lengths[region],
                    np.cumsum(inc_count) - inc_count, inc_count, base.inc_piece[inc] + shift[owner[inc_owner]])


def _tensors_with_partial_overlap(r_tensor: np.ndarray, r_off: np.ndarray, r_len: np.ndarray) -> np.ndarray:
    """Tensors whose distinct boxes are not provably disjoint.

    Sufficient test: along every dim, the distinct intervals of a tensor never overlap.
    Then two distinct boxes differ in some dim, where their intervals are disjoint.
    """
    bad: list[np.ndarray] = []
    for d in range(r_off.shape[1]):
        order, new = _group_rows([r_tensor, r_off[:, d], r_len[:, d]])
        first = order[new]
        t, off, ln = r_tensor[first], r_off[first, d], r_len[first, d]
        overlap = (t[1:] == t[:-1]) & (off[1:] < off[:-1] + ln[:-1])
        bad.append(t[1:][overlap])
    return np.unique(np.concatenate(bad)) if bad else np.zeros(0, dtype=np.int64)


def _refine(bad, tensor, offsets, lengths, r_tensor, r_off, r_len, inc_region, inc_piece):
    """Split the boxes of ``bad`` tensors into the elementary cells of their cut grid."""
    k = offsets.shape[1]
    keep_region = ~np.isin(r_tensor, bad)
    new_index = np.cumsum(keep_region) - 1
    keep_inc = keep_region[inc_region]
    out_t = [r_tensor[keep_region]]
    out_off = [r_off[keep_region]]
    out_len = [r_len[keep_region]]
    out_inc_region = [new_index[inc_region[keep_inc]]]
    out_inc_piece = [inc_piece[keep_inc]]
    next_region = int(keep_region.sum())
    for t in bad.tolist():
        rows = np.flatnonzero(tensor == t)
        cuts = [np.unique(np.concatenate([offsets[rows, d], offsets[rows, d] + lengths[rows, d]]))
                for d in range(k)]
        cell_ids: dict[tuple[int, ...], int] = {}
        for row in rows.tolist():
            axes = []
            for d in range(k):
                c = cuts[d]
                lo = np.searchsorted(c, offsets[row, d])
                hi = np.searchsorted(c, offsets[row, d] + lengths[row, d])
                axes.append(range(int(lo), int(hi)))
            for cell in np.ndindex(*[len(a) for a in axes]):
                key = tuple(axes[d][cell[d]] for d in range(k))
                region = cell_ids.get(key)
                if region is None:
                    region = cell_ids[key] = next_region
                    next_region += 1
                    out_t.append(np.array([t]))
                    out_off.append(np.array([[cuts[d][key[d]] for d in range(k)]]))
                    out_len.append(np.array([[cuts[d][key[d] + 1] - cuts[d][key[d]] for d in range(k)]]))
                out_inc_region.append(np.array([region]))
                out_inc_piece.append(np.array([row]))
    return (np.concatenate(out_t), np.concatenate(out_off), np.concatenate(out_len),
            np.concatenate(out_inc_region), np.concatenate(out_inc_piece))


# --------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------
def _match_tensors(source: Layout, destination: Layout) -> np.ndarray:
    """For each destination tensor, the source tensor id (shapes and dtypes must agree)."""
    mapping = np.full(len(destination.tensors), -1, dtype=np.int64)
    for i, t in enumerate(destination.tensors):
        try:
            j = source.tensor_index(t.name)
        except KeyError:
            raise ValueError(f"tensor {t.name!r} is in the destination layout but not in the source") from None
        s = source.tensors[j]
        if s.shape != t.shape or s.dtype != t.dtype:
            raise ValueError(
                f"tensor {t.name!r}: source is {list(s.shape)} {s.dtype}, destination is "
                f"{list(t.shape)} {t.dtype}"
            )
        mapping[i] = j
    return mapping


def _check_ranks(layout: Layout, topology: Topology, side: str) -> None:
    if layout.num_buffers and int(layout.buffer_rank.max()) >= topology.num_ranks:
        raise ValueError(
            f"{side} layout uses rank {int(layout.buffer_rank.max())} but the topology has "
            f"only {topology.num_ranks} ranks"
        )


def _check_destination_overlap(dst: Layout) -> None:
    """No two destination pieces may write the same bytes of one buffer."""
    if dst.__dict__.get("_no_overlap"):
        return
    _find_overlap(dst)
    # Removing ranks cannot create overlaps; derived layouts inherit this flag.
    object.__setattr__(dst, "_no_overlap", True)


def _find_overlap(dst: Layout) -> None:
    order = _stable_order(dst.piece_buffer)
    buf = dst.piece_buffer[order]
    starts, counts = _group_bounds(buf, dst.num_buffers)
    for size in np.unique(counts[counts > 1]).tolist():
        groups = np.flatnonzero(counts == size)
        members = order[starts[groups][:, None] + np.arange(size)[None, :]]  # [G, size]
        ii, jj = np.triu_indices(size, k=1)
        a, b = members[:, ii].reshape(-1), members[:, jj].reshape(-1)
        lo = np.maximum(dst.piece_local_offsets[a], dst.piece_local_offsets[b])
        hi = np.minimum(dst.piece_local_offsets[a] + dst.piece_local_lengths[a],
                        dst.piece_local_offsets[b] + dst.piece_local_lengths[b])
        hit = np.flatnonzero(np.all(hi > lo, axis=1))
        if hit.size:
            pa, pb = dst.piece(int(a[hit[0]])), dst.piece(int(b[hit[0]]))
            raise ValueError(
                f"destination pieces overlap in buffer {pa.buffer!r} on rank {pa.rank}: "
                f"tensor {pa.tensor!r} {pa.box} at {pa.local_box} and tensor {pb.tensor!r} "
                f"{pb.box} at {pb.local_box}"
            )


# --------------------------------------------------------------------------------------
# the planner
# --------------------------------------------------------------------------------------
def make_plan(
    source: Layout,
    destination: Layout,
    topology: Topology,
    options: PlanOptions | None = None,
) -> Plan:
    """Plan one refit from ``source`` to ``destination`` on ``topology``.

    Raises ``ValueError`` naming the tensor and ranks for mismatched tensors, destination
    regions that no source piece covers, overlapping destination pieces, or ranks outside
    the topology.
    """
    options = options or PlanOptions()
    tensor_map = _match_tensors(source, destination)
    _check_ranks(source, topology, "source")
    _check_ranks(destination, topology, "destination")
    _check_destination_overlap(destination)

    domain_of_rank = np.unique(topology.domain_array(), return_inverse=True)[1].astype(np.int64)
    num_ranks = topology.num_ranks
    classes = tensor_classes(source, destination, tensor_map)
    instances = np.diff(classes.start)[classes.class_of]  # members per class, per tensor
    # The rows' many intermediates die with _transfer_rows, before the schedule allocates:
    # it reuses their memory instead of faulting in fresh pages (~1 us per 4 KiB here).
    table, lower_bound_bytes = _transfer_rows(source, destination, options, tensor_map, classes, instances,
                                              domain_of_rank)
    table, counts = _schedule(table, options.bucket_bytes, instances, num_ranks)

    stats, per_rank = _stats(
        table, counts, classes, source, destination, tensor_map, domain_of_rank, num_ranks,
        lower_bound_bytes,
    )
    fingerprint = _fingerprint(source, destination, topology, options, classes, table)
    return Plan(
        source=source,
        destination=destination,
        topology=topology,
        options=options,
        transfers=table,
        classes=classes,
        source_tensor=tensor_map,
        stats=stats,
        fingerprint=fingerprint,
        network_send_bytes=per_rank[0],
        network_recv_bytes=per_rank[1],
        intra_send_bytes=per_rank[2],
        intra_recv_bytes=per_rank[3],
    )


def _transfer_rows(source: Layout, destination: Layout, options: PlanOptions, tensor_map: np.ndarray,
                   classes: TensorClasses, instances: np.ndarray, domain_of_rank: np.ndarray):
    """The table's rows (stages 1-4 of the module docstring) and the lower bound in bytes."""
    k = max(source.ndim, destination.ndim)
    num_domains = int(domain_of_rank.max()) + 1
    num_ranks = domain_of_rank.size
    is_rep = np.zeros(len(destination.tensors), dtype=bool)
    is_rep[classes.representative] = True

    # Pieces of representative tensors only; source pieces are renumbered into destination
    # tensor ids (tensors the destination does not hold are dropped).
    dst_id_of_src = np.full(len(source.tensors), -1, dtype=np.int64)
    dst_id_of_src[tensor_map] = np.arange(tensor_map.size)
    s_tensor_all = dst_id_of_src[source.piece_tensor]
    s_rows = np.flatnonzero(s_tensor_all >= 0)
    s_rows = s_rows[is_rep[s_tensor_all[s_rows]]]
    d_rows = np.flatnonzero(is_rep[destination.piece_tensor])
    src_regions = _layout_regions(source, s_rows, s_tensor_all[s_rows], k)
    dst_regions = _layout_regions(destination, d_rows, destination.piece_tensor[d_rows], k)
    atoms = _atoms(src_regions, dst_regions, k)
    _check_coverage(atoms, dst_regions, d_rows, destination)
    # Boxes above half a bucket are split here, once per atom rather than once per transfer.
    a_tensor, a_off, a_len, a_src, a_dst, a_nbytes = _split_oversized(atoms, destination.tensor_itemsize,
                                                                        options.max_transfer_bytes)
    a_weight = a_nbytes * instances[a_tensor]  # bytes of one copy, times the class's members

    # Needers: (atom, destination piece) incidence rows.
    n_atom, n_pos = _expand(dst_regions.inc_start[a_dst], dst_regions.inc_count[a_dst])
    n_piece = d_rows[dst_regions.inc_piece[n_pos]]
    n_rank = destination.piece_rank[n_piece]
    n_domain = domain_of_rank[n_rank]
    # Holders: (atom, source piece) incidence rows; source piece ids are layout rows.
    h_atom, h_pos = _expand(src_regions.inc_start[a_src], src_regions.inc_count[a_src])
    h_piece = s_rows[src_regions.inc_piece[h_pos]]
    h_rank = source.piece_rank[h_piece]
    h_domain = domain_of_rank[h_rank]

    # Demands: group needer rows by (atom, domain); sort inside by rank for determinism.
    n_order = _order_or_none([n_atom, n_domain, n_rank, n_piece],
                             [a_tensor.size, num_domains, num_ranks, destination.num_pieces])
    if n_order is not None:
        n_atom, n_piece, n_rank, n_domain = n_atom[n_order], n_piece[n_order], n_rank[n_order], n_domain[n_order]
    n_key = n_atom * num_domains + n_domain
    new_demand = np.ones(n_key.size, dtype=bool)
    new_demand[1:] = n_key[1:] != n_key[:-1]
    demand_first = np.flatnonzero(new_demand)
    demand_count = np.diff(np.append(demand_first, n_key.size))
    demand_atom = n_atom[demand_first]

    # Held demands: only domains with a holder can hold one (often none: training and
    # inference pools are disjoint), so only those demands are looked up.
    holder_domain = np.zeros(num_domains, dtype=bool)
    holder_domain[h_domain] = True
    maybe = np.flatnonzero(holder_domain[n_domain[demand_first]])
    held = np.zeros(demand_first.size, dtype=bool)
    if maybe.size:
        held[maybe] = np.isin(n_key[demand_first[maybe]], h_atom * num_domains + h_domain)
    lower_bound_bytes = int(a_weight[demand_atom[~held]].sum())

    held_rows = np.flatnonzero(np.repeat(held, demand_count)) if maybe.size else maybe
    net = np.flatnonzero(~held)
    # Free what the rows no longer need before the table is allocated, so that it reuses
    # their memory rather than faulting in fresh pages.
    del n_key, new_demand, n_pos, h_pos
    # The table is allocated once and each part writes its rows in place: held needers,
    # then one network row per network demand, then the fan-outs of shared demands.
    num_fan_out = int(demand_count[net].sum()) - net.size
    table = _empty_table(held_rows.size + net.size + num_fan_out, k)
    atoms = (a_tensor, a_off, a_len, a_nbytes)
    # -- demands served inside the domain (a source rank of the domain holds the atom) --
    if held_rows.size:
        _serve_held(table, held_rows, n_atom, n_piece, n_rank, n_domain, h_atom, h_piece, h_rank,
                    h_domain, num_domains, num_ranks, atoms)
    # -- demands that cross the network once, then fan out --
    if net.size:
        _serve_network(table, held_rows.size, net, demand_first, demand_count, demand_atom, n_piece,
                       n_rank, a_src, a_weight, src_regions, s_rows, source, num_ranks, atoms)
    return table, lower_bound_bytes


def tensor_classes(source: Layout, destination: Layout, tensor_map: np.ndarray) -> TensorClasses:
    """Group destination tensors whose shape, dtype and (rank, box) pieces agree on both sides.

    Transformer layers repeat, so a model of a thousand tensors has a few dozen to a few
    hundred classes; the planner plans one representative each.
    """
    src_ids = source.tensor_layout_ids()[tensor_map]
    dst_ids = destination.tensor_layout_ids()
    key = src_ids * (int(dst_ids.max(initial=0)) + 1) + dst_ids
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    # Classes in the order of their first member; members in tensor order.
    order = np.argsort(first)
    rank_of = np.empty_like(order)
    rank_of[order] = np.arange(order.size)
    class_of = rank_of[inverse]
    sizes = np.bincount(class_of, minlength=order.size)
    return TensorClasses(
        representative=first[order],
        start=np.concatenate([[0], np.cumsum(sizes)]),
        members=np.argsort(class_of, kind="stable"),
        class_of=class_of,
    )


def _atoms(src: _Regions, dst: _Regions, k: int):
    """All non-empty (source region x destination region) intersections, per tensor."""
    num_tensors = int(max(src.tensor.max(initial=-1), dst.tensor.max(initial=-1))) + 1
    s_start, s_count = _group_bounds(src.tensor, num_tensors)
    d_owner, s_idx = _expand(s_start[dst.tensor], s_count[dst.tensor])
    s_off, d_off = np.take(src.offsets, s_idx, axis=0), np.take(dst.offsets, d_owner, axis=0)
    lo = np.maximum(s_off, d_off)
    hi = np.minimum(s_off + np.take(src.lengths, s_idx, axis=0), d_off + np.take(dst.lengths, d_owner, axis=0))
    hi -= lo  # the intersection's lengths
    keep = hi[:, 0] > 0
    for j in range(1, k):  # column by column: ~5x faster than np.all(axis=1)
        keep &= hi[:, j] > 0
    keep = np.flatnonzero(keep)
    d_owner, s_idx = d_owner[keep], s_idx[keep]
    return dst.tensor[d_owner], np.take(lo, keep, axis=0), np.take(hi, keep, axis=0), s_idx, d_owner


def _check_coverage(atoms, dst: _Regions, d_rows: np.ndarray, destination: Layout) -> None:
    _, _, a_len, _, a_dst = atoms
    covered = np.bincount(a_dst, weights=_volume(a_len).astype(np.float64), minlength=dst.tensor.size)
    need = _volume(dst.lengths).astype(np.float64)
    short = np.flatnonzero(covered < need)
    if short.size:
        r = int(short[0])
        t = destination.tensors[int(dst.tensor[r])]
        nd = len(t.shape)
        pieces = d_rows[dst.inc_piece[dst.inc_start[r] : dst.inc_start[r] + dst.inc_count[r]]]
        box = Box(tuple(dst.offsets[r, :nd]), tuple(dst.lengths[r, :nd]))
        raise ValueError(
            f"tensor {t.name!r}: destination box {box} on ranks {destination.describe_ranks(pieces)} "
            f"is not covered by any source piece ({int(covered[r])} of {int(need[r])} elements covered)"
        )


_ROW_COLUMNS = ("kind", "phase", "tensor", "src_side", "src_piece", "dst_piece", "src_rank", "dst_rank", "nbytes")


def _empty_table(n: int, k: int) -> dict[str, np.ndarray]:
    table = {name: np.empty(n, dtype=np.int64) for name in _ROW_COLUMNS}
    table["offsets"] = np.empty((n, k), dtype=np.int64)
    table["lengths"] = np.empty((n, k), dtype=np.int64)
    return table


def _write_rows(table, rows: slice, kind, phase, src_side, atom, atoms) -> None:
    """Rows ``rows`` of the table, one box copy of ``atom[i]`` each: all but the pieces and
    ranks at both ends, which the caller writes."""
    table["kind"][rows] = kind
    table["phase"][rows] = phase
    table["src_side"][rows] = src_side
    # The atom's tensor, bytes and box, gathered straight into the table ("clip" skips the
    # buffered bounds check; atom ids are in range by construction).
    a_tensor, a_off, a_len, a_nbytes = atoms
    np.take(a_tensor, atom, out=table["tensor"][rows], mode="clip")
    np.take(a_nbytes, atom, out=table["nbytes"][rows], mode="clip")
    np.take(a_off, atom, axis=0, out=table["offsets"][rows], mode="clip")
    np.take(a_len, atom, axis=0, out=table["lengths"][rows], mode="clip")


def _serve_held(table, rows, n_atom, n_piece, n_rank, n_domain, h_atom, h_piece, h_rank, h_domain,
                num_domains, num_ranks, atoms):
    """Needers whose domain holds the atom (the table's first rows): a local copy if their own
    rank holds it, else an intra-domain copy from a holder of the domain (rotating over
    holders to spread load)."""
    atom, piece, rank, domain = n_atom[rows], n_piece[rows], n_rank[rows], n_domain[rows]
    # holder rows sorted by (atom, rank) and by (atom, domain, rank)
    num_atoms, num_pieces = int(h_atom.max(initial=0)) + 1, int(h_piece.max(initial=0)) + 1
    by_rank = _order_or_none([h_atom, h_rank, h_piece], [num_atoms, num_ranks, num_pieces])
    by_rank = np.arange(h_atom.size) if by_rank is None else by_rank
    key_rank = h_atom[by_rank] * num_ranks + h_rank[by_rank]
    want_rank = atom * num_ranks + rank
    pos = np.searchsorted(key_rank, want_rank)
    pos_c = np.minimum(pos, max(key_rank.size - 1, 0))
    local = (pos < key_rank.size) & (key_rank[pos_c] == want_rank)
    src_piece = np.where(local, h_piece[by_rank][pos_c], -1)
    src_rank = np.where(local, rank, -1)

    by_domain = _order_or_none([h_atom, h_domain, h_rank, h_piece], [num_atoms, num_domains, num_ranks, num_pieces])
    by_domain = np.arange(h_atom.size) if by_domain is None else by_domain
    key_domain = h_atom[by_domain] * num_domains + h_domain[by_domain]
    remote = np.flatnonzero(~local)
    want = atom[remote] * num_domains + domain[remote]
    lo = np.searchsorted(key_domain, want, side="left")
    hi = np.searchsorted(key_domain, want, side="right")
    pick = lo + (rank[remote] % (hi - lo))
    src_piece[remote] = h_piece[by_domain][pick]
    src_rank[remote] = h_rank[by_domain][pick]
    kind = np.where(local, int(TransferKind.LOCAL), int(TransferKind.INTRA))
    out = slice(0, atom.size)
    _write_rows(table, out, kind, Phase.DELIVER, SourceSide.SOURCE, atom, atoms)
    table["src_piece"][out], table["src_rank"][out] = src_piece, src_rank
    table["dst_piece"][out], table["dst_rank"][out] = piece, rank


def _serve_network(table, at, net, demand_first, demand_count, demand_atom, n_piece, n_rank, a_src,
                   a_bytes, src_regions, s_rows, source, num_ranks, atoms):
    """One network transfer per demand into a receiver (rows from ``at``), then fan-out to the
    other needers (the rows after those)."""
    if net.size == demand_first.size:  # no held demands (disjoint pools): no copies
        atom, first, cnt = demand_atom, demand_first, demand_count
    else:
        atom, first, cnt = demand_atom[net], demand_first[net], demand_count[net]
    region = a_src[atom]
    start, count = src_regions.inc_start[region], src_regions.inc_count[region]
    choice = _choose_senders(region, start, count, a_bytes[atom], src_regions, s_rows, source, num_ranks)
    # Receivers rotate among the demand's needers in the domain (replicas); most have one.
    shared = np.flatnonzero(cnt > 1)
    receiver_row = first.copy()
    receiver_row[shared] += atom[shared] % cnt[shared]

    rows = slice(at, at + net.size)
    _write_rows(table, rows, TransferKind.NETWORK, Phase.DELIVER, SourceSide.SOURCE, atom, atoms)
    sender_piece, receiver_piece = table["src_piece"][rows], table["dst_piece"][rows]
    receiver_rank = table["dst_rank"][rows]
    np.take(s_rows, src_regions.inc_piece[start + choice], out=sender_piece, mode="clip")
    np.take(source.piece_rank, sender_piece, out=table["src_rank"][rows], mode="clip")
    np.take(n_piece, receiver_row, out=receiver_piece, mode="clip")
    np.take(n_rank, receiver_row, out=receiver_rank, mode="clip")

    # Fan-out from the receiver to the demand's other needers.
    owner, row = _expand(first[shared], cnt[shared])
    owner = shared[owner]
    others = row != receiver_row[owner]
    owner, row = owner[others], row[others]
    fan = slice(rows.stop, rows.stop + owner.size)
    _write_rows(table, fan, TransferKind.INTRA, Phase.FAN_OUT, SourceSide.DESTINATION, atom[owner], atoms)
    table["src_piece"][fan], table["src_rank"][fan] = receiver_piece[owner], receiver_rank[owner]
    table["dst_piece"][fan], table["dst_rank"][fan] = n_piece[row], n_rank[row]


def _choose_senders(region, start, count, nbytes, src_regions, s_rows, source, num_ranks):
    """Index (into each region's holders) of the sender of every network demand.

    Single-holder demands are forced. Replica groups are then visited from the heaviest
    down; each assigns its demands (largest first) round-robin over its holders ordered
    by current load, which is greedy least-loaded for equal sizes.
    """
    choice = np.zeros(region.size, dtype=np.int64)
    load = np.zeros(num_ranks, dtype=np.int64)
    holder_rank = source.piece_rank[s_rows[src_regions.inc_piece]]
    forced = count == 1
    np.add.at(load, holder_rank[start[forced]], nbytes[forced])
    multi = np.flatnonzero(~forced)
    if multi.size == 0:
        return choice
    # by region, then largest first (a stable sort keeps demand order among equals)
    top = int(nbytes[multi].max())
    order = multi[_stable_order(region[multi] * (top + 1) + (top - nbytes[multi]))]
    reg_sorted = region[order]
    boundaries = np.flatnonzero(np.diff(reg_sorted)) + 1
    groups = np.split(order, boundaries)
    totals = np.add.reduceat(nbytes[order], np.append(0, boundaries))
    group_order = np.lexsort((reg_sorted[np.append(0, boundaries)], -totals))
    for gi in group_order.tolist():
        g = groups[gi]
        s, c = int(start[g[0]]), int(count[g[0]])
        ranks = holder_rank[s : s + c]
        by_load = np.lexsort((np.arange(c), ranks, load[ranks]))
        picks = by_load[np.arange(g.size) % c]
        choice[g] = picks
        np.add.at(load, ranks[picks], nbytes[g])
    return choice


def _split_oversized(atoms, itemsize: np.ndarray, limit: int):
    """Split atoms above ``limit`` bytes along their outermost dims until every box fits;
    returns the atoms and their bytes."""
    tensor, offsets, lengths, src, dst = atoms
    while True:
        nbytes = _volume(lengths) * itemsize[tensor]
        big = np.flatnonzero(nbytes > limit)
        if big.size == 0:
            return tensor, offsets, lengths, src, dst, nbytes
        ln = lengths[big]
        splittable = ln > 1
        if not splittable.any(axis=1).all():
            raise ValueError(f"a bucket of {limit * 2} bytes cannot hold two elements of every tensor")
        rows = np.arange(big.size)
        dim = np.argmax(splittable, axis=1)
        slab = nbytes[big] // ln[rows, dim]  # bytes of one index along `dim`
        per_chunk = np.maximum(limit // slab, 1)
        chunks = np.ones(nbytes.size, dtype=np.int64)
        chunks[big] = -(-ln[rows, dim] // per_chunk)
        tensor, src, dst = np.repeat(tensor, chunks), np.repeat(src, chunks), np.repeat(dst, chunks)
        offsets, lengths = np.repeat(offsets, chunks, axis=0), np.repeat(lengths, chunks, axis=0)
        owner, position = _expand((np.cumsum(chunks) - chunks)[big], chunks[big])
        index = position - (np.cumsum(chunks) - chunks)[big][owner]
        d = dim[owner]
        start = index * per_chunk[owner]
        offsets[position, d] += start
        lengths[position, d] = np.minimum(per_chunk[owner], ln[owner, d] - start)


def _schedule(table: dict[str, np.ndarray], bucket_bytes: int, instances: np.ndarray,
              num_ranks: int) -> tuple[TransferTable, dict[str, int]]:
    """Canonical order, messages, shift-schedule rounds and buckets."""
    tensor = table["tensor"]
    nbytes = table.pop("nbytes")  # written with the rows, from the atoms
    phase, src, dst = table["phase"], table["src_rank"], table["dst_rank"]
    is_local = table["kind"] == int(TransferKind.LOCAL)

    # Per phase, senders and receivers are numbered densely and a message's round is its
    # shift (receiver - sender) modulo the width; local copies need no peer (round -1).
    # All phases at once: a phase's ids are counted within its row of a [phase, id] table.
    num_phases = len(Phase)
    peer = np.flatnonzero(~is_local) if is_local.any() else None

    def dense_in_phase(ids: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        """Per row, the rank of its id among the ids its phase uses; and per phase, how many."""
        slot = phase * size
        slot += ids
        present = np.zeros((num_phases, size), dtype=bool)
        present.reshape(-1)[slot if peer is None else slot[peer]] = True
        return np.take((np.cumsum(present, axis=1) - 1).reshape(-1), slot), present.sum(axis=1)

    s_idx, num_senders = dense_in_phase(src, num_ranks)
    r_idx, num_receivers = dense_in_phase(dst, num_ranks)
    width = np.maximum(np.maximum(num_senders, num_receivers), 1)
    shift = r_idx - s_idx
    shift += width[phase] * (shift < 0)  # modulo the width, without a division
    if peer is not None:
        shift[is_local] = 0  # no peer: their ids are not counted, their shift is meaningless
    rounds, used = dense_in_phase(shift, int(width.max()))
    num_rounds = int(used.sum())
    if peer is not None:
        rounds[is_local] = -1

    # One stable sort on a packed (phase, round, src, dst) key; inside a message rows keep
    # their generation order. Rows themselves stay in generation order (deterministic); only
    # message ids and offsets need the sorted order, so compute them there and scatter back.
    count = instances[tensor]
    weight = nbytes * count
    n = src.size
    if (len(Phase) * (num_rounds + 1) * num_ranks * num_ranks).bit_length() <= 62:
        key = phase * (num_rounds + 1)
        key += rounds
        key += 1
        key *= num_ranks
        key += src
        key *= num_ranks
        key += dst
        order, sorted_key = _stable_sort(key)
        new_msg = np.ones(n, dtype=bool)
        new_msg[1:] = sorted_key[1:] != sorted_key[:-1]
    else:
        order, new_msg = _group_rows([phase, rounds, src, dst])
    s_message = np.cumsum(new_msg) - 1
    msg_first = np.flatnonzero(new_msg)
    s_weight = weight[order]
    s_start = np.cumsum(s_weight) - s_weight
    s_offset = s_start - np.repeat(s_start[msg_first], np.diff(np.append(msg_first, n)))
    message = np.empty(n, dtype=np.int64)
    message_offset = np.empty(n, dtype=np.int64)
    message[order], message_offset[order] = s_message, s_offset
    # Buckets per message: the bucket of its last copy, plus one.
    msg_last = np.append(msg_first[1:], n)[: msg_first.size] - 1
    half = max(bucket_bytes // 2, 1)
    last_row = order[msg_last]
    last_copy = s_offset[msg_last] + (count[last_row] - 1) * nbytes[last_row]
    local_msg = table["kind"][order[msg_first]] == int(TransferKind.LOCAL)
    counts = {
        "messages": int(np.count_nonzero(~local_msg)),
        "buckets": int((last_copy[~local_msg] // half + 1).sum()),
        "rounds": num_rounds,
    }
    table = TransferTable(**table, round=rounds, message=message, message_offset=message_offset,
                          nbytes=nbytes, instances=count)
    return table, counts


def _stats(table: TransferTable, counts: dict[str, int], classes: TensorClasses, source: Layout,
           destination: Layout, tensor_map: np.ndarray, domain_of_rank: np.ndarray, num_ranks: int,
           lower_bound_bytes: int):
    kind = table.kind
    weight = table.nbytes * table.instances
    # Bytes per (kind, rank), sent and received, in one bincount each; totals per kind are
    # their row sums (whole numbers far below 2**53, so the float sums are exact).
    num_kinds = len(TransferKind)
    send, recv = (
        np.bincount(kind * num_ranks + ranks, weights=weight, minlength=num_kinds * num_ranks)
        .astype(np.int64).reshape(num_kinds, num_ranks)
        for ranks in (table.src_rank, table.dst_rank)
    )
    kind_bytes = send.sum(axis=1)
    kind_copies = np.bincount(kind, weights=table.instances, minlength=num_kinds).astype(np.int64)
    net_send, net_recv = send[TransferKind.NETWORK], recv[TransferKind.NETWORK]
    intra_send, intra_recv = send[TransferKind.INTRA], recv[TransferKind.INTRA]
    used = np.zeros(num_ranks, dtype=bool)
    used[list(source.ranks)] = True
    used[list(destination.ranks)] = True
    stats = PlanStats(
        model_bytes=int(_tensor_nbytes(destination).sum()),
        dst_bytes=destination.nbytes,
        lower_bound_bytes=lower_bound_bytes,
        cross_domain_bytes=int(kind_bytes[TransferKind.NETWORK]),
        intra_domain_bytes=int(kind_bytes[TransferKind.INTRA]),
        local_bytes=int(kind_bytes[TransferKind.LOCAL]),
        gather_broadcast_bytes=gather_broadcast_bytes(source, destination, tensor_map),
        max_send_bytes=int(net_send.max(initial=0)),
        max_recv_bytes=int(net_recv.max(initial=0)),
        transfers=int(kind_copies.sum()),
        rows=len(table),
        tensor_classes=classes.num_classes,
        network_transfers=int(kind_copies[TransferKind.NETWORK]),
        intra_transfers=int(kind_copies[TransferKind.INTRA]),
        local_transfers=int(kind_copies[TransferKind.LOCAL]),
        messages=counts["messages"],
        rounds=counts["rounds"],
        buckets=counts["buckets"],
        num_source_ranks=len(source.ranks),
        num_destination_ranks=len(destination.ranks),
        num_domains=int(np.unique(domain_of_rank[used]).size),
    )
    return stats, (net_send, net_recv, intra_send, intra_recv)


def _tensor_nbytes(layout: Layout) -> np.ndarray:
    """Bytes of every logical tensor (shapes are padded with 1)."""
    return _volume(layout.tensor_shape) * layout.tensor_itemsize


def gather_broadcast_bytes(source: Layout, destination: Layout, tensor_map: np.ndarray | None = None) -> int:
    """Bytes the classic refit moves: each tensor gathered whole on one source rank (the one
    holding most of it), then sent whole to every other rank holding part of it."""
    if tensor_map is None:
        tensor_map = _match_tensors(source, destination)
    stride = int(max(source.buffer_rank.max(initial=0), destination.buffer_rank.max(initial=0))) + 1
    # bytes each (source tensor, rank) holds; pieces are sorted by (tensor, rank)
    keys, inverse = _sorted_unique(source.piece_tensor * stride + source.piece_rank)
    held = np.bincount(inverse, weights=source.piece_nbytes()).astype(np.int64)
    held_tensor, held_rank = keys // stride, keys % stride
    order = _lexsort([held_tensor, -held, held_rank])  # per tensor: most bytes, then lowest rank
    first = np.ones(order.size, dtype=bool)
    first[1:] = held_tensor[order][1:] != held_tensor[order][:-1]
    root_rank = np.full(len(source.tensors), -1, dtype=np.int64)
    root_held = np.zeros(len(source.tensors), dtype=np.int64)
    root_rank[held_tensor[order][first]] = held_rank[order][first]
    root_held[held_tensor[order][first]] = held[order][first]

    # Receivers per tensor: its destination ranks, less the root when the root is one of them.
    # Pieces are sorted by tensor, then rank, so (tensor, rank) pairs are runs of one key.
    pair = destination.piece_tensor * stride + destination.piece_rank
    first_of_pair = np.ones(pair.size, dtype=bool)
    first_of_pair[1:] = pair[1:] != pair[:-1]
    num_tensors = len(destination.tensors)
    receivers = np.bincount(destination.piece_tensor[first_of_pair], minlength=num_tensors)
    if pair.size:
        root = root_rank[tensor_map]  # -1: the tensor has no source bytes (an empty tensor)
        root_pair = np.arange(num_tensors) * stride + root
        at = np.minimum(np.searchsorted(pair, root_pair), pair.size - 1)
        receivers -= (root >= 0) & (pair[at] == root_pair)
    t_bytes = _tensor_nbytes(destination)
    gather = np.maximum(t_bytes - root_held[tensor_map], 0)
    return int((gather + t_bytes * receivers).sum())


# Columns that define a plan; the rest (ranks, sizes, messages) are derived from them.
_DEFINING_COLUMNS = ("kind", "phase", "round", "message_offset", "tensor", "src_side",
                     "src_piece", "dst_piece", "offsets", "lengths")


def _fingerprint(source: Layout, destination: Layout, topology: Topology, options: PlanOptions,
                 classes: TensorClasses, table: TransferTable) -> str:
    digest = hashlib.sha256()  # about twice blake2b's speed here, for tens of MB of columns
    digest.update(f"planner={PLANNER_VERSION};bucket={options.bucket_bytes};direct={options.direct_min_bytes}".encode())
    digest.update(source.fingerprint.encode())
    digest.update(destination.fingerprint.encode())
    digest.update(topology.fingerprint().encode())
    update_int_arrays(digest, [("class_members", classes.members), ("class_start", classes.start)]
                      + [(name, getattr(table, name)) for name in _DEFINING_COLUMNS])
    return digest.hexdigest()[:32]
