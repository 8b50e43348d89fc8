"""One rank's plan from symbolic layouts (issue 40): ``make_rank_plan_from_rules``.

``make_rank_plan`` needs both sides' explicit layouts, one piece per tensor per rank: at
8,192 GPUs of Kimi-K2 building them costs seconds and a gigabyte before the plan starts.
Here a rank plans from the rules (``SymbolicLayout``) and derives only what its rows depend
on, with the same stages and the same code (``plan.rank._Shared``):

* the tensor classes, from each side's ``tensor_layout_ids`` computed on the rules;
* the source side's pieces of the representative tensors on every rank: every replica of a
  region competes as a sender, and the senders' balance is global;
* the destination side's pieces of the representative tensors on a skeleton of ranks (per
  rule, one position per distinct box: so the regions and atoms are every region and atom)
  and on the rank's own domain; then, once the senders are known, on the domains this rank
  sends to (only the tensors it sends there);
* each destination region's set of needer domains, from the rules (per distinct mesh and
  box, the domains of the ranks that hold the box), which is all the senders need of the
  destination side;
* ``relay="auto"``: an upper bound of any rank's network receive bytes (per rule, its
  largest piece, summed over the rules that cover a rank's range) against the busiest
  sender; where the bound cannot settle it, the rank falls back to explicit layouts.

So the cost grows with the source side's replicas of the representative tensors and the
rank's own peers, not with the destination side's ranks. The rows equal
``rank_slice(make_plan(source.to_layout(), destination.to_layout(), ...), rank)`` with piece
ids into the view's own layouts, which hold the pieces of the ranks the rows name, every
tensor of a class (property-tested). Layouts with explicit pieces plan explicitly.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from elastic_refit.layout import Layout, Topology
from elastic_refit.layout.symbolic import SymbolicLayout
from elastic_refit.layout.symbolic_rules import _rule_pieces
from elastic_refit.plan.planner import (
    _atom_stage,
    _check_destination_overlap,
    _layout_regions,
    _match_tensors,
    _messages,
    _round_space,
    _rounds,
    classes_of_layout_ids,
)
from elastic_refit.plan.rank import (
    _check_rank,
    _relayed_error,
    _Shared,
    make_rank_plan,
    plan_input_fingerprint,
)
from elastic_refit.plan.types import PlanOptions, RankPlan, SourceSide

__all__ = ["make_rank_plan_from_rules"]


def make_rank_plan_from_rules(source: SymbolicLayout, destination: SymbolicLayout, topology: Topology,
                              options: PlanOptions | None = None, *, rank: int) -> RankPlan:
    """Rank ``rank``'s view of the plan from ``source`` to ``destination`` (symbolic layouts),
    as ``make_rank_plan`` gives it from their explicit layouts (module docstring): the same
    rows, rounds, messages and fingerprint, piece ids into the view's own (partial) layouts.

    ``ValueError`` as ``make_rank_plan`` (mismatched tensors, uncovered regions, ranks outside
    the topology, relayed plans)."""
    options = options or PlanOptions()
    rank = _check_rank(rank, topology)
    if source.explicit is not None or destination.explicit is not None:
        return make_rank_plan(source.to_layout(), destination.to_layout(), topology, options, rank=rank)
    if options.relay == "on":
        raise _relayed_error(options)
    tensor_map = _match_tensors(_Names(source), _Names(destination))
    for side, layout in (("source", source), ("destination", destination)):
        top = max((r.mesh.max_rank for r in layout.buffers), default=-1)
        if top >= topology.num_ranks:
            raise ValueError(f"{side} layout uses rank {top} but the topology has only {topology.num_ranks} ranks")
    domain_of_rank = np.unique(topology.domain_array(), return_inverse=True)[1].astype(np.int64)
    classes = classes_of_layout_ids(source.tensor_layout_ids[tensor_map], destination.tensor_layout_ids)
    instances = np.diff(classes.start)[classes.class_of]
    reps = classes.representative.tolist()
    src_names = {source.tensors[tensor_map[t]].name: None for t in reps}  # None: every rank
    src = source.piece_table(src_names)
    domain = _domain_ranks(domain_of_rank, [int(domain_of_rank[rank])])
    boxes = _Boxes()
    skeleton = _skeleton(destination, {destination.tensors[t].name for t in reps}, boxes)
    dst_ranks = {name: np.union1d(ranks, domain) for name, ranks in skeleton.items()}
    dst = destination.piece_table(dst_ranks)
    src_rows, dst_rows, src_regions, dst_regions, atoms = _atom_stage(src, dst, options, tensor_map, classes)
    sets = _needer_domain_sets(destination, dst, dst_regions, domain_of_rank, boxes)
    shared = _Shared(src, dst, domain_of_rank, instances, src_rows, dst_rows, src_regions, dst_regions, atoms,
                     dst_domain_sets=sets)
    if options.relay == "auto" and _receive_bound(destination, instances, classes.representative, boxes) > int(shared.senders.load.max(initial=0)):
        return make_rank_plan(source.to_layout(), destination.to_layout(), topology, options, rank=rank)
    sent = shared.sent_demands(rank)
    if sent is not None:  # the needers of the domains it sends to, of the tensors it sends there
        atom, _, _, demand_domain = sent
        tensor = atoms[0][atom]
        for t in np.unique(tensor).tolist():
            name = destination.tensors[t].name
            extra = _domain_ranks(domain_of_rank, np.unique(demand_domain[tensor == t]))
            dst_ranks[name] = np.union1d(dst_ranks[name], extra)
        dst = destination.piece_table(dst_ranks)
        dst_rows = np.arange(dst.num_pieces, dtype=np.int64)
        regions = _layout_regions(dst, dst_rows, dst.piece_tensor, max(src.ndim, dst.ndim))
        if not (np.array_equal(regions.tensor, dst_regions.tensor) and np.array_equal(regions.offsets,
                                                                                      dst_regions.offsets)
                and np.array_equal(regions.lengths, dst_regions.lengths)):
            raise AssertionError("destination regions changed with more ranks: the skeleton missed a box")
        shared.set_destination(dst, dst_rows, regions)
    table = shared.rows_of(rank)
    space = _round_space(_ranks_of(source), _ranks_of(destination), domain_of_rank, relayed=False)
    transfers, _ = _messages(table, _rounds(table, space), space.num_rounds, options.bucket_bytes, instances,
                             topology.num_ranks)
    src_view, dst_view, transfers = _view_layouts(source, destination, src, dst, transfers, classes, tensor_map)
    _check_destination_overlap(dst_view)  # the pieces this rank sees (the full layout is never built)
    return RankPlan(rank=rank, source=src_view, destination=dst_view, topology=topology, options=options,
                    transfers=transfers, classes=classes, source_tensor=tensor_map,
                    fingerprint=plan_input_fingerprint(source, destination, topology, options),  # type: ignore[arg-type]
                    num_rounds=space.num_rounds, relayed=False)


class _Names:
    """What ``_match_tensors`` reads of a layout: its tensors and their index by name."""

    def __init__(self, layout: SymbolicLayout) -> None:
        self.tensors = layout.tensors
        self._index = {t.name: i for i, t in enumerate(layout.tensors)}

    def tensor_index(self, name: str) -> int:
        return self._index[name]


def _ranks_of(layout: SymbolicLayout) -> SimpleNamespace:
    """What ``_round_space`` reads of a layout: the ranks holding a buffer (from the meshes)."""
    parts = [np.unique(b.mesh.ranks(np.arange(b.mesh.size))) for b in {b.mesh: b for b in layout.buffers}.values()]
    return SimpleNamespace(ranks=np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64))


def _domain_ranks(domain_of_rank: np.ndarray, domains) -> np.ndarray:
    return np.flatnonzero(np.isin(domain_of_rank, np.asarray(domains, dtype=np.int64)))


class _Boxes:
    """Per (mesh, cut axes): each position's box index among the distinct combinations of the
    cut axes' coordinates (a box depends on nothing else), and each box's first position.
    Models repeat a few meshes over all their rules: each is decoded once per plan."""

    def __init__(self) -> None:
        self._memo: dict = {}

    def of(self, mesh, splits) -> tuple[tuple, np.ndarray, np.ndarray]:
        """(key, box index per position, first position per box)."""
        axes = tuple(sorted({s.axis for s in splits if s.axis >= 0}))
        key = (mesh, axes)
        hit = self._memo.get(key)
        if hit is None:
            if not axes:
                box = np.zeros(mesh.size, dtype=np.int64)
            else:
                coords = mesh.coords(np.arange(mesh.size))
                box = np.ravel_multi_index(tuple(coords[:, a] for a in axes), tuple(mesh.shape[a] for a in axes))
            hit = self._memo[key] = (key, box, np.unique(box, return_index=True)[1])
        return hit


def _skeleton(layout: SymbolicLayout, names: set[str], boxes: _Boxes) -> dict[str, np.ndarray]:
    """Per tensor of ``names``, ranks holding every distinct box of its rules (one position per
    combination of the cut axes' coordinates)."""
    out: dict[str, list[np.ndarray]] = {name: [] for name in names}
    memo: dict = {}
    for rule in layout.rules:
        if rule.tensor not in out:
            continue
        key, _, first = boxes.of(rule.mesh, rule.splits)
        if key not in memo:
            memo[key] = rule.mesh.ranks(first)
        out[rule.tensor].append(memo[key])
    return {name: np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
            for name, parts in out.items()}


def _needer_domain_sets(layout: SymbolicLayout, dst: Layout, regions, domain_of_rank: np.ndarray, boxes: _Boxes):
    """Per destination region (of the representative tensors), the id of its set of needer
    domains over the whole side, and the sets (``rank._domain_sets``'s form): a region's
    needers are the ranks of every (rule, box) whose box contains it."""
    index = {name: i for i, name in enumerate(t.name for t in dst.tensors)}
    first = np.searchsorted(regions.tensor, np.arange(len(dst.tensors) + 1))
    member_sets: list[list[int]] = [[] for _ in range(regions.tensor.size)]
    domain_sets: dict = {}  # (mesh, cut axes) -> per box: its domains
    pieces_memo: dict = {}
    shapes = {t.name: t.shape for t in layout.tensors}
    for rule in layout.rules:
        t = index[rule.tensor]
        lo, hi = int(first[t]), int(first[t + 1])
        if lo == hi:  # not a representative
            continue
        key, box, positions = boxes.of(rule.mesh, rule.splits)
        if key not in domain_sets:
            pairs = np.unique(np.stack([box, domain_of_rank[rule.mesh.ranks(np.arange(rule.mesh.size))]], axis=1),
                              axis=0)
            starts = np.searchsorted(pairs[:, 0], np.arange(int(box.max()) + 2))
            domain_sets[key] = pairs, starts
        at, offsets, lengths = _skeleton_pieces(shapes[rule.tensor], rule, positions, pieces_memo)
        k = len(shapes[rule.tensor])
        r_off, r_len = regions.offsets[lo:hi, :k], regions.lengths[lo:hi, :k]
        inside = np.all((r_off[None] >= offsets[:, None]) & (r_off[None] + r_len[None]
                                                              <= (offsets + lengths)[:, None]), axis=2)
        for piece, region in zip(*np.nonzero(inside), strict=True):
            member_sets[lo + int(region)].append((key, int(box[positions[at[piece]]])))
    return _dedupe_sets(member_sets, domain_sets)


def _dedupe_sets(member_sets, domain_sets):
    """(set id per region, sets): each region's domains, the union of its (mesh, box) sets,
    numbered by first region as ``rank._domain_sets`` numbers them."""
    ids: dict[bytes, int] = {}
    sets: list[np.ndarray] = []
    set_of = np.empty(len(member_sets), dtype=np.int64)
    of_members: dict[tuple, int] = {}  # regions of one (mesh, box) list share their set
    for r, members in enumerate(member_sets):
        members = tuple(dict.fromkeys(members))
        found = of_members.get(members)
        if found is None:
            parts = []
            for key, b in members:
                pairs, starts = domain_sets[key]
                parts.append(pairs[starts[b]: starts[b + 1], 1])  # sorted, distinct
            if len(parts) == 1:
                values = parts[0]
            else:
                values = np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
            found = of_members[members] = ids.setdefault(values.tobytes(), len(sets))
            if found == len(sets):
                sets.append(values)
        set_of[r] = found
    return set_of, sets


def _skeleton_pieces(shape, rule, positions, memo: dict):
    """``_rule_pieces`` (index, offsets, lengths) of a rule's first positions per box; rules
    of one shape, mesh and cuts (layers) share them."""
    key = (shape, rule.mesh, rule.splits)
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = _rule_pieces(shape, rule, positions)[:3]
    return hit


def _receive_bound(layout: SymbolicLayout, instances: np.ndarray, representatives: np.ndarray, boxes: _Boxes) -> int:
    """At least the network bytes any destination rank receives: per rule of a representative
    tensor, the bytes (class members counted) of its largest position, summed over the rules
    whose rank range covers a rank, the largest such sum."""
    index = {t.name: i for i, t in enumerate(layout.tensors)}
    planned = set(representatives.tolist())
    pieces_memo: dict = {}
    events: list[tuple[int, int]] = []
    for rule in layout.rules:
        if index[rule.tensor] not in planned:
            continue
        t = layout.tensors[index[rule.tensor]]
        _, _, positions = boxes.of(rule.mesh, rule.splits)
        at, _, lengths = _skeleton_pieces(t.shape, rule, positions, pieces_memo)
        per_position = np.bincount(at, weights=np.prod(lengths, axis=1).astype(np.float64), minlength=positions.size)
        nbytes = int(per_position.max(initial=0)) * t.itemsize * int(instances[index[rule.tensor]])
        events += [(rule.mesh.min_rank, nbytes), (rule.mesh.max_rank + 1, -nbytes)]
    events.sort()
    running = best = 0
    for _, delta in events:
        running += delta
        best = max(best, running)
    return best


def _view_layouts(source, destination, src, dst, transfers, classes, tensor_map):
    """The view's layouts (every tensor of a class on the ranks its rows name) and its rows'
    piece ids renumbered into them."""
    t = transfers
    from_source = t.src_side == int(SourceSide.SOURCE)
    picks = ((src, t.src_piece[from_source]),
             (dst, np.concatenate([t.dst_piece[t.dst_piece >= 0], t.src_piece[~from_source]])))
    views = []
    for (internal, pieces), symbolic, is_source in zip(picks, (source, destination), (True, False), strict=True):
        ranks_of: dict[str, list[int]] = {}
        rep_ranks: dict[int, np.ndarray] = {}
        for rep in np.unique(internal.piece_tensor[pieces]).tolist():
            rep_ranks[rep] = np.unique(internal.piece_rank[pieces[internal.piece_tensor[pieces] == rep]])
        for d, members in _members(classes, tensor_map, is_source):
            for rep in [d] if d in rep_ranks else []:
                for m in members:
                    ranks_of[internal.tensors[m].name] = rep_ranks[rep]
        views.append(symbolic.layout_of_tensor_ranks(ranks_of))
    src_view, dst_view = views
    columns = t.columns()
    columns["src_piece"] = np.where(from_source, _renumber(src, src_view, t.src_piece),
                                    _renumber(dst, dst_view, t.src_piece))
    columns["dst_piece"] = np.where(t.dst_piece >= 0, _renumber(dst, dst_view, t.dst_piece), t.dst_piece)
    return src_view, dst_view, type(t)(**columns)


def _members(classes, tensor_map, is_source):
    """(representative, members) per class, as tensor ids of one side."""
    for c, rep in enumerate(classes.representative.tolist()):
        members = classes.members[classes.start[c]: classes.start[c + 1]]
        if is_source:
            yield int(tensor_map[rep]), tensor_map[members].tolist()
        else:
            yield int(rep), members.tolist()


def _renumber(internal: Layout, view: Layout, pieces: np.ndarray) -> np.ndarray:
    """Ids in ``view`` of ``internal``'s pieces (both in layout order; ``view`` holds every piece
    of a (tensor, rank) that ``internal`` holds there)."""
    safe = np.clip(pieces, 0, max(internal.num_pieces - 1, 0))
    n = max(int(internal.piece_rank.max(initial=0)), int(view.piece_rank.max(initial=0))) + 1
    key_in = internal.piece_tensor * n + internal.piece_rank
    key_view = view.piece_tensor * n + view.piece_rank
    start_in = np.searchsorted(key_in, key_in[safe])
    start_view = np.searchsorted(key_view, key_in[safe])
    return start_view + (safe - start_in)
