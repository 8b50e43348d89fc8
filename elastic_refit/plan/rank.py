"""Per-rank plans: one rank's rows of a plan, without building the whole transfer table.

A rank builds what every rank shares from the layouts, once per region and atom rather than
per row: tensor classes, regions and atoms (once per class), each atom's demands (the
destination domains that need it, found per distinct (needer domains, holder domains) pair
of its two regions), the senders among replicas (``planner._network_senders``, decided per
replica group from runs of equal demands, the same code and decisions as the full plan), and
whether ``relay="auto"`` would relay. Then it builds only the rows it sends, receives or
copies, with the full plan's rules: held demands served in the domain (local copy, or an
intra copy from the domain's holders in rotation), one network row per other demand into a
receiver rotating over the domain's needers, fan-outs from the receiver. Rounds follow from
a row's two ranks (``planner._RoundSpace``), stream offsets from the rank's own messages. So
its cost grows with its own rows plus the atoms and regions, not with the plan's rows, and
``make_rank_plan(..., rank=r)`` equals ``rank_slice(make_plan(...), r)`` (property-tested).

Ranks cannot hash rows they never built, so they agree on the fingerprint of the plan's
*inputs* (``plan_input_fingerprint``) before any byte moves; the inputs determine every row.

From symbolic layouts (rules), ``plan.rank_rules.make_rank_plan_from_rules`` derives what
``_Shared`` needs of each side without building either side's explicit layout.

Relayed plans (``PlanOptions.relay``) are refused for now: a forward row takes the stream
offset of its network row, which lives in a message the needer is not part of. Where
``relay="auto"`` cannot be settled from per-rank figures (some receiver would be busier than
the busiest sender), the rank falls back to deciding every row, as the full plan does.
"""

from __future__ import annotations

import hashlib

import numpy as np

from elastic_refit.layout import Layout, Topology
from elastic_refit.layout.casts import SourceCast, cast_layout
from elastic_refit.plan.planner import (
    PLANNER_VERSION,
    _atom_columns,
    _atom_stage,
    _expand,
    _group_bounds,
    _inputs,
    _lexsort,
    _messages,
    _network_senders,
    _order_or_none,
    _plan_rows,
    _round_space,
    _rounds,
    _stable_order,
    _stable_sort,
)
from elastic_refit.plan.types import (
    Phase,
    Plan,
    PlanOptions,
    RankPlan,
    SourceSide,
    TransferKind,
    TransferTable,
)

__all__ = ["make_rank_plan", "plan_input_fingerprint", "rank_slice"]


def plan_input_fingerprint(source: Layout, destination: Layout, topology: Topology,
                           options: PlanOptions | None = None) -> str:
    """Fingerprint of what determines a plan: both layouts, the topology, the options and
    ``PLANNER_VERSION``. Equal on every rank that would build the same plan; ranks compare it
    before data moves (``RankPlan.fingerprint``)."""
    options = options or PlanOptions()
    digest = hashlib.sha256()
    # "inputs;" keeps these apart from fingerprints of whole plans, which hash their rows
    digest.update(f"inputs;planner={PLANNER_VERSION};bucket={options.bucket_bytes};direct={options.direct_min_bytes};"
                  f"concurrent_rounds={options.concurrent_rounds};relay={options.relay};".encode())
    for part in (source.fingerprint, destination.fingerprint, topology.fingerprint()):
        digest.update(part.encode())
        digest.update(b";")
    return digest.hexdigest()[:32]


def _check_rank(rank: object, topology: Topology) -> int:
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or not 0 <= rank < topology.num_ranks:
        raise ValueError(f"rank must be an integer in [0, {topology.num_ranks}), got {rank!r}")
    return int(rank)


def _relayed_error(options: PlanOptions) -> ValueError:
    return ValueError(f"per-rank plans of relayed plans are not supported (relay={options.relay!r} relays "
                      f"here): build the full plan with make_plan, or plan with relay='off'")


def make_rank_plan(source: Layout, destination: Layout, topology: Topology, options: PlanOptions | None = None,
                   *, rank: int) -> RankPlan:
    """Rank ``rank``'s view of ``make_plan(source, destination, topology, options)``: the rows
    it sends, receives or copies, equal to ``rank_slice(make_plan(...), rank)``.

    ``ValueError`` for the inputs ``make_plan`` refuses, a rank outside the topology, and a
    plan that relays (``relay="on"``, or ``"auto"`` where balance relays): build the full plan,
    or plan with ``relay="off"``.
    """
    options = options or PlanOptions()
    rank = _check_rank(rank, topology)
    fingerprint = plan_input_fingerprint(source, destination, topology, options)  # the source as given
    cast = SourceCast.between(source, destination)
    if cast is not None:  # planned in the destination's dtypes, as make_plan does
        source = cast_layout(source, cast.dtypes)
    tensor_map, classes, instances, domain_of_rank = _inputs(source, destination, topology)
    src_rows, dst_rows, src_regions, dst_regions, atoms = _atom_stage(source, destination, options, tensor_map,
                                                                      classes)
    if options.relay == "on":
        raise _relayed_error(options)
    shared = _Shared(source, destination, domain_of_rank, instances, src_rows, dst_rows, src_regions, dst_regions,
                     atoms)
    if options.relay == "auto" and shared.receivers_may_relay():
        table, instances = _rows_of_full_plan(source, destination, topology, options, rank)
    else:
        table = shared.rows_of(rank)
    space = _round_space(source, destination, domain_of_rank, relayed=False)
    transfers, _ = _messages(table, _rounds(table, space), space.num_rounds, options.bucket_bytes, instances,
                             topology.num_ranks)
    return RankPlan(rank=rank, source=source, destination=destination, topology=topology, options=options,
                    transfers=transfers, classes=classes, source_tensor=tensor_map, fingerprint=fingerprint,
                    num_rounds=space.num_rounds, relayed=False, cast=cast)


def _rows_of_full_plan(source, destination, topology, options, rank):
    """Every row decided as the full plan does, then the rank's kept (``relay="auto"`` where
    per-rank figures cannot settle it)."""
    rows = _plan_rows(source, destination, topology, options, figures=False)
    if rows.relayed:
        raise _relayed_error(options)
    table = rows.table
    keep = np.flatnonzero((table["src_rank"] == rank) | (table["dst_rank"] == rank))
    return _atom_columns({name: column[keep] for name, column in table.items()}, rows.atoms), rows.instances


class _Shared:
    """What every rank derives alike from the layouts, per region and atom (see the module
    docstring), and the rows of one rank (``rows_of``)."""

    def __init__(self, source, destination, domain_of_rank, instances, src_rows, dst_rows, src_regions,
                 dst_regions, atoms, dst_domain_sets=None):
        """``dst_domain_sets``: per destination region, the id of its set of needer domains,
        and the sets; derived from ``destination`` when not given (a per-rank planner over
        rules gives them, holding only some destination ranks' pieces)."""
        self.source, self.domain_of_rank = source, domain_of_rank
        self.num_ranks = num_ranks = domain_of_rank.size
        self.num_domains = num_domains = int(domain_of_rank.max()) + 1
        self.src_rows, self.src_regions = src_rows, src_regions
        atom_tensor, atom_offsets, atom_lengths, atom_src, atom_dst, atom_nbytes = atoms
        self.atoms = (atom_tensor, atom_offsets, atom_lengths, atom_nbytes)
        self.atom_src, self.atom_dst = atom_src, atom_dst
        self.atom_weight = atom_nbytes * instances[atom_tensor]
        # Needers per destination region and holders per source region, sorted by (region,
        # domain, rank, piece): a demand's needers and a domain's holders are runs of these.
        self.set_destination(destination, dst_rows, dst_regions)
        self.s_region, self.s_domain, self.s_rank, self.s_piece = _incidence(src_regions, src_rows,
                                                                             source.piece_rank, domain_of_rank,
                                                                             source.num_pieces)
        self.sd_key = self.s_region * num_domains + self.s_domain
        by_rank = _order_or_none([self.s_region, self.s_rank, self.s_piece],
                                 [src_regions.tensor.size, num_ranks, source.num_pieces])
        by_rank = np.arange(self.s_region.size) if by_rank is None else by_rank
        self.sr_key = self.s_region[by_rank] * num_ranks + self.s_rank[by_rank]
        self.sr_piece = self.s_piece[by_rank]
        # Atoms per destination region and per source region.
        self.atoms_by_dst = _stable_order(atom_dst)
        self.dst_atom_start, self.dst_atom_count = _group_bounds(atom_dst[self.atoms_by_dst], dst_regions.tensor.size)
        self.atoms_by_src = _stable_order(atom_src)
        self.src_atom_start, self.src_atom_count = _group_bounds(atom_src[self.atoms_by_src], src_regions.tensor.size)
        # Network domains of every atom: the needer domains of its destination region less
        # the holder domains of its source region, per distinct pair of those domain sets.
        dst_set, dst_sets = dst_domain_sets or _domain_sets(self.d_region, self.d_domain, dst_regions.tensor.size)
        src_set, src_sets = _domain_sets(self.s_region, self.s_domain, src_regions.tensor.size)
        pair_key = dst_set[atom_dst] * len(src_sets) + src_set[atom_src]
        pairs, self.atom_pair = np.unique(pair_key, return_inverse=True)
        self.atom_pair = self.atom_pair.reshape(-1)
        nets = [np.setdiff1d(dst_sets[p // len(src_sets)], src_sets[p % len(src_sets)], assume_unique=True)
                for p in pairs.tolist()]
        helds = [np.intersect1d(dst_sets[p // len(src_sets)], src_sets[p % len(src_sets)], assume_unique=True)
                 for p in pairs.tolist()]
        self.held_count = np.array([h.size for h in helds], dtype=np.int64)
        self.held_start = np.cumsum(self.held_count) - self.held_count
        self.held_domain = np.concatenate(helds) if helds else np.zeros(0, dtype=np.int64)
        self.net_count = np.array([n.size for n in nets], dtype=np.int64)
        self.net_start = np.cumsum(self.net_count) - self.net_count
        self.net_domain = np.concatenate(nets) if nets else np.zeros(0, dtype=np.int64)
        self.net_key = np.repeat(np.arange(pairs.size), self.net_count) * num_domains + self.net_domain
        # Senders: one run per atom with network demands (its demands in domain order).
        atom_count = self.net_count[self.atom_pair]
        run_atom = np.flatnonzero(atom_count > 0)
        self.run_of_atom = np.full(atom_dst.size, -1, dtype=np.int64)
        self.run_of_atom[run_atom] = np.arange(run_atom.size)
        self.senders = _network_senders(run_atom, atom_src[run_atom], self.atom_weight[run_atom],
                                        atom_count[run_atom], src_regions, src_rows, source, num_ranks)

    def set_destination(self, destination, dst_rows, dst_regions) -> None:
        """The needers (d_* incidence) from ``destination``'s pieces ``dst_rows`` (regions
        ``dst_regions``, the same regions as the atoms'): every needer of the domains that
        the rank's rows look up must be among them."""
        self.d_region, self.d_domain, self.d_rank, self.d_piece = _incidence(
            dst_regions, dst_rows, destination.piece_rank, self.domain_of_rank, destination.num_pieces)
        self.rd_key = self.d_region * self.num_domains + self.d_domain

    # ---- lookups -----------------------------------------------------------------------
    def _needers(self, region, domain):
        """(first, count) of the needers of (destination region, domain) in the d_* arrays."""
        return self._run(self.rd_key, region, domain)

    def _holders(self, region, domain):
        """(first, count) of the holders of (source region, domain) in the s_* arrays."""
        return self._run(self.sd_key, region, domain)

    def _run(self, sorted_key, region, domain):
        key = region * self.num_domains + domain
        first = np.searchsorted(sorted_key, key, side="left")
        return first, np.searchsorted(sorted_key, key, side="right") - first

    def _local_piece(self, region, rank):
        """The first piece of ``region`` on ``rank`` (-1: none)."""
        key = region * self.num_ranks + rank
        at = np.minimum(np.searchsorted(self.sr_key, key), max(self.sr_key.size - 1, 0))
        found = (self.sr_key.size > 0) & (self.sr_key[at] == key)
        return np.where(found, self.sr_piece[at], -1)

    def _receiver(self, atom, domain):
        """Needer row (into d_*) receiving demand (atom, domain), rotating over its needers."""
        first, count = self._needers(self.atom_dst[atom], domain)
        return first + np.where(count > 1, atom % np.maximum(count, 1), 0), first, count

    def _sender_piece(self, atom, run, j):
        choice = self.senders.choice(run, j)
        region = self.atom_src[atom]
        piece = self.src_rows[self.src_regions.pieces[self.src_regions.piece_start[region] + choice]]
        return piece, self.source.piece_rank[piece]

    def receivers_may_relay(self) -> bool:
        """``relay="auto"`` relays only where some receiver (rotating over each demand's needers)
        gets more network bytes than the busiest sender; False when none does. Summed per
        (destination region, domain): a demand whose domain has one needer goes to it whatever
        the atom, so such a needer receives its region's network bytes less those its domain
        holds; only domains with several needers rotate by atom."""
        if self.senders.run_atom.size == 0:
            return False
        busiest_send = int(self.senders.load.max())
        run_atom = self.senders.run_atom
        num_regions = self.dst_atom_start.size
        # per (region, domain) needer group: its first needer and how many
        new = np.append(True, self.rd_key[1:] != self.rd_key[:-1])
        group_first = np.flatnonzero(new)
        group_key = self.rd_key[group_first]
        group_count = np.diff(np.append(group_first, self.rd_key.size))
        region_bytes = np.bincount(self.atom_dst[run_atom], weights=self.atom_weight[run_atom],
                                   minlength=num_regions).astype(np.int64)  # whole bytes, exact
        group_bytes = region_bytes[group_key // self.num_domains]
        # less what the group's domain holds: (region, atom pair) sums over the held domains
        num_pairs = self.net_count.size
        key = self.atom_dst[run_atom] * num_pairs + self.atom_pair[run_atom]
        order, sorted_key = _stable_sort(key)
        first = np.flatnonzero(np.append(True, sorted_key[1:] != sorted_key[:-1]))
        pair_bytes = np.add.reduceat(self.atom_weight[run_atom[order]], first)
        pair, region = sorted_key[first] % num_pairs, sorted_key[first] // num_pairs
        owner, at = _expand(self.held_start[pair], self.held_count[pair])
        held = np.searchsorted(group_key, region[owner] * self.num_domains + self.held_domain[at])
        np.subtract.at(group_bytes, held, pair_bytes[owner])
        one = group_count == 1
        load = np.bincount(self.d_rank[group_first[one]], weights=group_bytes[one],
                           minlength=self.num_ranks).astype(np.int64)
        rotating = np.flatnonzero(~one)
        if rotating.size:  # every network atom of the region, to the needer its id rotates to
            region = group_key[rotating] // self.num_domains
            domain = group_key[rotating] % self.num_domains
            owner, at = _expand(self.dst_atom_start[region], self.dst_atom_count[region])
            atom = self.atoms_by_dst[at]
            domain = domain[owner]
            network = (self.run_of_atom[atom] >= 0) & (self._holders(self.atom_src[atom], domain)[1] == 0)
            owner, atom = owner[network], atom[network]
            receiver = group_first[rotating][owner] + atom % group_count[rotating][owner]
            np.add.at(load, self.d_rank[receiver], self.atom_weight[atom])
        return int(load.max()) > busiest_send

    # ---- one rank's rows ----------------------------------------------------------------
    def rows_of(self, rank: int) -> dict[str, np.ndarray]:
        """The rank's rows, in the full plan's generation order: held needers (section 1),
        network rows (2), fan-outs (3); inside each by (atom, domain, needer rank, piece)."""
        parts: list[dict[str, np.ndarray]] = []
        domain = int(self.domain_of_rank[rank])
        self._as_needer(rank, domain, parts)
        self._as_holder(rank, domain, parts)
        keys = ("section", "atom", "domain", "order_rank", "order_piece")
        columns = {name: np.concatenate([p[name] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
                   for name in (*keys, "kind", "phase", "src_side", "src_piece", "dst_piece", "src_rank",
                                "dst_rank")}
        order = _lexsort([columns[name] for name in keys])
        table = {name: columns[name][order] for name in ("kind", "phase", "atom", "src_side", "src_piece",
                                                          "dst_piece", "src_rank", "dst_rank")}
        return _atom_columns(table, self.atoms)

    def _as_needer(self, rank, domain, parts):
        mine = np.flatnonzero(self.d_rank == rank)
        region = self.d_region[mine]
        owner, at = _expand(self.dst_atom_start[region], self.dst_atom_count[region])
        atom, needer = self.atoms_by_dst[at], mine[owner]
        piece = self.d_piece[needer]
        src_region = self.atom_src[atom]
        first_holder, num_holders = self._holders(src_region, domain)
        held = num_holders > 0
        # -- held: a local copy, else an intra copy from the domain's holders in rotation --
        h = np.flatnonzero(held)
        local_piece = self._local_piece(src_region[h], rank)
        local = local_piece >= 0
        pick = first_holder[h] + rank % np.maximum(num_holders[h], 1)
        parts.append(_part(1, atom[h], domain, rank, piece[h],
                           kind=np.where(local, int(TransferKind.LOCAL), int(TransferKind.INTRA)),
                           phase=int(Phase.DELIVER), src_side=int(SourceSide.SOURCE),
                           src_piece=np.where(local, local_piece, self.s_piece[pick]),
                           src_rank=np.where(local, rank, self.s_rank[pick]), dst_piece=piece[h], dst_rank=rank))
        # -- network demands of the rank's domain --
        n = np.flatnonzero(~held)
        atom, needer, piece = atom[n], needer[n], piece[n]
        receiver, first, count = self._receiver(atom, np.full(atom.size, domain, dtype=np.int64))
        is_receiver = receiver == needer
        r = np.flatnonzero(is_receiver)
        j = np.searchsorted(self.net_key, self.atom_pair[atom[r]] * self.num_domains + domain) \
            - self.net_start[self.atom_pair[atom[r]]]
        sender_piece, sender_rank = self._sender_piece(atom[r], self.run_of_atom[atom[r]], j)
        parts.append(_part(2, atom[r], domain, 0, 0, kind=int(TransferKind.NETWORK), phase=int(Phase.DELIVER),
                           src_side=int(SourceSide.SOURCE), src_piece=sender_piece, src_rank=sender_rank,
                           dst_piece=piece[r], dst_rank=rank))
        # fan-outs from this receiver to the demand's other needers
        fan_owner, other = _expand(first[r], count[r])
        keep = other != receiver[r][fan_owner]
        fan_owner, other = fan_owner[keep], other[keep]
        parts.append(_part(3, atom[r][fan_owner], domain, self.d_rank[other], self.d_piece[other],
                           kind=int(TransferKind.INTRA), phase=int(Phase.FAN_OUT),
                           src_side=int(SourceSide.DESTINATION), src_piece=piece[r][fan_owner], src_rank=rank,
                           dst_piece=self.d_piece[other], dst_rank=self.d_rank[other]))
        # fan-outs into this needer from another rank's receiver (its own are written above)
        f = np.flatnonzero(~is_receiver & (self.d_rank[receiver] != rank))
        parts.append(_part(3, atom[f], domain, rank, piece[f], kind=int(TransferKind.INTRA),
                           phase=int(Phase.FAN_OUT), src_side=int(SourceSide.DESTINATION),
                           src_piece=self.d_piece[receiver[f]], src_rank=self.d_rank[receiver[f]],
                           dst_piece=piece[f], dst_rank=rank))

    def _as_holder(self, rank, domain, parts):
        atom = self.holder_atoms(rank)
        # -- intra copies this rank serves to needers of its domain that hold nothing --
        first, count = self._needers(self.atom_dst[atom], np.full(atom.size, domain, dtype=np.int64))
        need_owner, needer = _expand(first, count)
        need_atom = atom[need_owner]
        needer_rank = self.d_rank[needer]
        src_region = self.atom_src[need_atom]
        remote = np.flatnonzero(self._local_piece(src_region, needer_rank) < 0)
        need_atom, needer, needer_rank, src_region = need_atom[remote], needer[remote], needer_rank[remote], \
            src_region[remote]
        first_holder, num_holders = self._holders(src_region, domain)
        pick = first_holder + needer_rank % num_holders
        mine = np.flatnonzero(self.s_rank[pick] == rank)
        parts.append(_part(1, need_atom[mine], domain, needer_rank[mine], self.d_piece[needer[mine]],
                           kind=int(TransferKind.INTRA), phase=int(Phase.DELIVER), src_side=int(SourceSide.SOURCE),
                           src_piece=self.s_piece[pick[mine]], src_rank=rank, dst_piece=self.d_piece[needer[mine]],
                           dst_rank=needer_rank[mine]))
        # -- network demands this rank sends --
        sent = self.sent_demands(rank, atom)
        if sent is None:
            return
        atom, run, j, demand_domain = sent
        receiver = self._receiver(atom, demand_domain)[0]
        sender_piece, sender_rank = self._sender_piece(atom, run, j)
        parts.append(_part(2, atom, demand_domain, 0, 0, kind=int(TransferKind.NETWORK), phase=int(Phase.DELIVER),
                           src_side=int(SourceSide.SOURCE), src_piece=sender_piece, src_rank=sender_rank,
                           dst_piece=self.d_piece[receiver], dst_rank=self.d_rank[receiver]))

    def holder_atoms(self, rank: int) -> np.ndarray:
        """The atoms of every source region ``rank`` holds."""
        regions = np.unique(self.s_region[self.s_rank == rank])
        _, at = _expand(self.src_atom_start[regions], self.src_atom_count[regions])
        return self.atoms_by_src[at]

    def sent_demands(self, rank: int, atom: np.ndarray | None = None):
        """(atom, run, j, domain) of every network demand ``rank`` sends (None: none); ``atom``:
        ``holder_atoms(rank)`` where known. Needs no needer: senders follow from the atoms'
        network domains."""
        atom = self.holder_atoms(rank) if atom is None else atom
        runs = self.run_of_atom[atom]
        runs = np.unique(runs[runs >= 0])
        sent_run, sent_j = [], []
        senders = self.senders
        group = senders.run_group[runs]
        forced = runs[group < 0]  # a single holder (this rank) sends every demand
        if forced.size:
            forced_owner, j = _expand(np.zeros(forced.size, dtype=np.int64), senders.run_count[forced])
            sent_run.append(forced[forced_owner])
            sent_j.append(j)
        start = self.src_regions.piece_start
        for g in np.unique(group[group >= 0]).tolist():
            group_runs = runs[group == g]
            region = int(self.atom_src[senders.run_atom[group_runs[0]]])
            holder_pieces = self.src_rows[self.src_regions.pieces[start[region]: start[region]
                                                                  + self.src_regions.piece_count[region]]]
            mine = np.flatnonzero(self.source.piece_rank[holder_pieces] == rank)
            run, j = senders.runs_sent_by(g, mine, group_runs)
            sent_run.append(run)
            sent_j.append(j)
        if not sent_run:
            return None
        run, j = np.concatenate(sent_run), np.concatenate(sent_j)
        atom = senders.run_atom[run]
        return atom, run, j, self.net_domain[self.net_start[self.atom_pair[atom]] + j]


def _part(section, atom, domain, order_rank, order_piece, **columns) -> dict[str, np.ndarray]:
    """Rows of one kind, with their sort keys; scalars are broadcast to the rows."""
    size = atom.size
    out = {"section": np.full(size, section, dtype=np.int64), "atom": atom}
    for name, value in (("domain", domain), ("order_rank", order_rank), ("order_piece", order_piece),
                        *columns.items()):
        out[name] = np.broadcast_to(np.asarray(value, dtype=np.int64), (size,))
    return out


def _incidence(regions, rows, piece_rank, domain_of_rank, num_pieces):
    """(region, domain, rank, piece) of every (region, piece) incidence, sorted so."""
    region, at = _expand(regions.piece_start, regions.piece_count)
    piece = rows[regions.pieces[at]]
    rank = piece_rank[piece]
    domain = domain_of_rank[rank]
    order = _order_or_none([region, domain, rank, piece],
                           [max(regions.tensor.size, 1), int(domain_of_rank.max()) + 1, domain_of_rank.size,
                            max(num_pieces, 1)])
    if order is not None:
        region, domain, rank, piece = region[order], domain[order], rank[order], piece[order]
    return region, domain, rank, piece


def _domain_sets(region, domain, num_regions):
    """Per region, the id of its (sorted) set of domains, and the distinct sets."""
    new = np.ones(region.size, dtype=bool)
    new[1:] = (region[1:] != region[:-1]) | (domain[1:] != domain[:-1])
    region, domain = region[new], domain[new]
    starts, counts = _group_bounds(region, num_regions)
    ids: dict[bytes, int] = {}
    sets: list[np.ndarray] = []
    set_of = np.empty(num_regions, dtype=np.int64)
    for r, (start, count) in enumerate(zip(starts.tolist(), counts.tolist(), strict=True)):
        values = domain[start: start + count]
        key = values.tobytes()
        found = ids.get(key)
        if found is None:
            found = ids[key] = len(sets)
            sets.append(values)
        set_of[r] = found
    return set_of, sets


def rank_slice(plan: Plan, rank: int) -> RankPlan:
    """Rank ``rank``'s rows of a full plan, as ``make_rank_plan`` gives them (messages
    renumbered among the rank's own, in the same order). ``ValueError`` for a relayed plan,
    whose forwards point at rows outside the slice."""
    rank = _check_rank(rank, plan.topology)
    if plan.relayed:
        raise ValueError("a relayed plan has no per-rank slice (forwards point at other ranks' rows)")
    rows = plan.rows_for(rank)
    columns = {name: column[rows] for name, column in plan.transfers.columns().items()}
    columns["message"] = np.unique(columns["message"], return_inverse=True)[1].reshape(-1).astype(np.int64)
    domain_of_rank = np.unique(plan.topology.domain_array(), return_inverse=True)[1].astype(np.int64)
    space = _round_space(plan.source, plan.destination, domain_of_rank, relayed=False)
    return RankPlan(rank=rank, source=plan.source, destination=plan.destination, topology=plan.topology,
                    options=plan.options, transfers=TransferTable(**columns), classes=plan.classes,
                    source_tensor=plan.source_tensor,
                    fingerprint=plan_input_fingerprint(plan.cast.logical_source if plan.cast else plan.source,
                                                       plan.destination, plan.topology, plan.options),
                    num_rounds=space.num_rounds, relayed=False, cast=plan.cast)
