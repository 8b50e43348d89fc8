"""Pure decisions of the runtime: what moves next, the plan for it, and when to give up.

Given one epoch's membership view and a snapshot of the version state, ``next_action``
says whether a version can be committed, which attempt should run, or that there is
nothing to do. ``plan_attempt`` turns an attempt into a plan over the communicator ranks of
the epoch. Two kinds of members serve an attempt's bytes:

- **sources**: the live trainers, serving the version from the training layout;
- **holders**: the inference ranks that already hold the version, serving it from the
  inference layout (so a lost trainer replica is covered wherever the data still exists).

The **destinations** are the inference ranks that do not hold the version yet.

Each side describes itself: every member's record names the fingerprint of its side's
layout, and a trainer's source record the layout it published the version in. An attempt
carries the fingerprint it plans each participant with, and the plan takes each member's
own rows from the layout it named, so a side may change its layout between versions (or one
rank rejoin with another) and the next attempt plans against what each rank holds now.

An inference side may hold some tensors in a quantized destination format (its
description's ``TensorFormats``): every inference participant must declare the same ones
(``attempt_formats``), trainers' BF16 is then quantized on the senders, holders serve the
FP8 bytes and scales they hold to a catch-up, and never beside trainers (``next_action``'s
``holders_serve`` makes them destinations of a refit instead).

``attempt_cause`` and ``count_failure`` decide when a version is given up: after
``max_attempts`` consecutive attempts that failed for the same cause with the same members.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from elastic_refit._validate import is_integer
from elastic_refit.errors import brief
from elastic_refit.layout import Layout, TensorFormats, Topology, combine_layouts
from elastic_refit.layout.casts import source_casts
from elastic_refit.membership.attempts import CATCH_UP, REFIT, AttemptSpec, Done, DoneKind
from elastic_refit.membership.versions import Commit, VersionState
from elastic_refit.membership.view import MemberRecord, MembershipView
from elastic_refit.plan import Plan, PlanOptions, destination_format_layout, make_plan

_CAUSE_CHARS = 300


@dataclass(frozen=True, slots=True)
class CommitAction:
    """Every live inference rank holds ``version``: commit it with ``digest``."""

    version: int
    digest: str


def holds(state: VersionState, version: int, member: MemberRecord) -> bool:
    """An inference rank holds ``version`` if it acked it in its current incarnation and
    layout (a rank that changed its layout holds nothing until it receives a version)."""
    ack = state.acks.get(version, {}).get(member.member_id)
    return ack is not None and ack.incarnation == member.incarnation and ack.layout == member.layout


def _complete(state: VersionState, version: int, trainers: tuple[MemberRecord, ...],
              inference: tuple[MemberRecord, ...]) -> bool:
    """Every live inference rank holds ``version`` and a live trainer published it in its
    current incarnation: it may commit."""
    published = state.sources.get(version, {})
    return (bool(inference) and all(holds(state, version, m) for m in inference)
            and any(published.get(t.member_id) == t.incarnation for t in trainers))


def attempt_layouts(view: MembershipView, state: VersionState, version: int, sources: tuple[str, ...],
                    others: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """Which layout each participant is planned with: a source's is the one it published
    ``version`` in, a holder's or destination's (``others``) the one its record names."""
    published = state.source_layouts.get(version, {})
    out = {m: published.get(m, view.member(m).layout) for m in sources}
    out.update((m, view.member(m).layout) for m in others)
    return tuple(sorted(out.items()))


def version_digest(state: VersionState, version: int, members: tuple[MemberRecord, ...]) -> str:
    """Digest of a version as held by ``members``: their per-rank digests, in id order."""
    digest = hashlib.blake2b(digest_size=16)
    for m in sorted(members, key=lambda m: m.member_id):
        digest.update(f"{m.member_id}={state.acks[version][m.member_id].digest};".encode())
    return digest.hexdigest()


def next_action(view: MembershipView, state: VersionState,
                feasible: Callable[[AttemptSpec], bool] | None = None,
                holders_serve: Callable[[AttemptSpec], bool] | None = None) -> AttemptSpec | CommitAction | None:
    """What the epoch's coordinator does next (pure).

    1. The newest published version newer than every committed one: commit it as soon as
       every live inference rank holds it (and a live trainer published it in its current
       incarnation); else, once every live trainer has published it, an attempt to move it
       from its sources (every live trainer) and its holders. A trainer restarted since it
       published (an earlier incarnation's publish) is left out of the sources when the
       others cover the version, instead of waited for. Older
       uncommitted versions are superseded (by a failed one too): never proposed again,
       but one that every live inference rank holds already (a trainer one step ahead
       published the next version while it moved) is committed first, newest first: its
       bytes are there, verified, and the engines serve it while the newer one moves
       (before, its transfer was thrown away and its publisher's handle waited for the
       newer version's commit). A failed version is never proposed nor committed.
    2. Otherwise, inference ranks without the latest committed version catch up from its
       holders; the trainers are not involved.

    ``feasible(spec)`` (optional) says whether the live members hold every byte an attempt
    needs; an infeasible attempt is not proposed: the version waits for its sources or
    holders to come back. ``holders_serve(spec)`` (optional, default yes) says whether the
    holders of a refit can send beside its trainers; when not (an inference side in FP8:
    its holders hold the destination format, the trainers send BF16 that is quantized on the
    way), they receive the version again as destinations, from the trainers alone.
    """
    feasible = feasible or (lambda spec: True)
    trainers = view.members_of("trainer")
    inference = view.members_of("inference")
    latest = state.latest_committed
    pending = [v for v, published in state.sources.items() if published and (latest is None or v > latest)]
    if pending and max(pending) not in state.failed:
        version = max(pending)
        published = state.sources[version]
        # Trainers that published it in their current incarnation; one that published it in
        # an earlier incarnation has restarted since, and its buffers may not hold it.
        current = tuple(sorted(t.member_id for t in trainers if published.get(t.member_id) == t.incarnation))
        num_restarted = sum(1 for t in trainers if published.get(t.member_id, t.incarnation) != t.incarnation)
        holders = tuple(sorted(m.member_id for m in inference if holds(state, version, m)))
        destinations = tuple(sorted(m.member_id for m in inference if not holds(state, version, m)))
        if current and inference and not destinations:
            # Complete: every live inference rank holds it, verified against the digests
            # taken when it was published. A restarted trainer moves no byte of it: the
            # commit does not wait for it, and its own publish then finds the version
            # committed (same data, or refused).
            return CommitAction(version, version_digest(state, version, inference))
        overtaken = next((v for v in sorted(pending, reverse=True)[1:]
                          if v not in state.failed and _complete(state, v, trainers, inference)), None)
        if overtaken is not None:
            return CommitAction(overtaken, version_digest(state, overtaken, inference))
        if current and inference and len(current) + num_restarted == len(trainers):
            # The restarted trainers are not waited for (their start-up and their publish
            # again) when the others cover every byte (``feasible``).
            spec = AttemptSpec(version, REFIT, current, holders, destinations,
                               attempt_layouts(view, state, version, current, holders + destinations))
            if holders and holders_serve is not None and not holders_serve(spec):
                spec = replace(spec, holders=(), destinations=tuple(sorted(holders + destinations)))
            return spec if feasible(spec) else None
    if latest is not None and inference:
        holders = tuple(sorted(m.member_id for m in inference if holds(state, latest, m)))
        behind = tuple(sorted(m.member_id for m in inference if not holds(state, latest, m)))
        if holders and behind:
            spec = AttemptSpec(latest, CATCH_UP, (), holders, behind,
                               attempt_layouts(view, state, latest, (), holders + behind))
            if feasible(spec):
                return spec
    return None


def own_catch_up(view: MembershipView, state: VersionState, member_id: str) -> AttemptSpec | None:
    """The catch-up that would bring inference rank ``member_id`` to the latest committed
    version from its holders (pure), when it does not hold that version and no newer one is
    on its way (published and not failed: that one reaches it instead); else None. The
    rank asks whether the holders can cover it (a peer of a TP engine holds its own shard
    only): if not, the version cannot reach it."""
    latest = state.latest_committed
    if latest is None or member_id not in view or view.member(member_id).role != "inference":
        return None
    if state.committed[latest].epoch > view.epoch:
        # Committed in an epoch this rank has not seen: its view is behind (after an etcd
        # stall its own lease may be gone too, and the holders came back as new
        # incarnations). Judged from it, every holder looks gone; the newer view decides.
        return None
    inference = view.members_of("inference")
    if holds(state, latest, view.member(member_id)):
        return None
    if any(v > latest and v not in state.failed for v, published in state.sources.items() if published):
        return None
    holders = tuple(sorted(m.member_id for m in inference if holds(state, latest, m)))
    behind = tuple(sorted(m.member_id for m in inference if not holds(state, latest, m)))
    return AttemptSpec(latest, CATCH_UP, (), holders, behind, attempt_layouts(view, state, latest, (), holders + behind))


def steady_refit(view: MembershipView) -> AttemptSpec | None:
    """The attempt a new version gets in ``view`` once every trainer published it and no
    inference rank holds it yet (the usual refit): every trainer sends, every inference
    rank receives, each planned with its record's layout. ``None`` without trainers or
    without inference ranks. Its version (0) is a placeholder: plans do not depend on it."""
    trainers = tuple(sorted(m.member_id for m in view.members_of("trainer")))
    inference = tuple(sorted(m.member_id for m in view.members_of("inference")))
    if not trainers or not inference:
        return None
    layouts = tuple((m, view.member(m).layout) for m in trainers + inference)
    return AttemptSpec(0, REFIT, trainers, (), inference, layouts)


def check_publish(version: int, digest: str, member_id: str, state: VersionState,
                  last_published: tuple[int, str] | None = None) -> Commit | None:
    """What a trainer's ``publish(version)`` of buffers with ``digest`` means, given the job's
    versions (pure): the commit to return at once (a repeat of a committed version with the
    same data), ``None`` (a new version, or a retry of this trainer's pending one), or
    ``ValueError``. Versions increase strictly per job, and a version never changes its
    data: anything else would leave a version in etcd that does not say what it holds.
    ``last_published`` is this trainer's latest ``(version, digest)`` in this process."""
    if not is_integer(version) or version < 0:
        raise ValueError(f"version must be an integer >= 0, got {version!r}")
    committed = state.committed.get(version)
    if committed is not None:
        # The source record goes once a later version commits; the commit keeps the digest.
        recorded = state.source_digests.get(version, {}).get(member_id) or committed.source_digest(member_id)
        if recorded is not None and recorded != digest:
            raise ValueError(f"version {version} is already committed, and {member_id} published other data "
                             f"for it then (digest {recorded}, now {digest}): publish a new version, or, if "
                             "this is another run reusing the job's name, give it a name of its own")
        return committed
    latest = state.latest_committed
    if latest is not None and version < latest:
        raise ValueError(f"version {version} is older than the job's latest committed version {latest}: "
                         "versions must increase")
    if last_published is not None:
        last, last_digest = last_published
        if version < last:
            raise ValueError(f"version {version} is older than version {last}, which {member_id} published "
                             "before: versions must increase")
        if version == last and digest != last_digest:
            raise ValueError(f"version {version} was published by {member_id} before with other data "
                             f"(digest {last_digest}, now {digest}): publish a new version")
    return None


def topology_of(view: MembershipView) -> Topology:
    """Communicator ranks of the epoch grouped by the domains their members reported."""
    names = sorted({m.domain for m in view.members})
    index = {name: i for i, name in enumerate(names)}
    return Topology(tuple(index[m.domain] for m in view.members), tuple(m.host for m in view.members))


LayoutOf = Callable[[MemberRecord, str], Layout]
"""``layout_of(record, fingerprint)``: the layout a member is planned with (the attempt
names its fingerprint; "" when it names none)."""


def by_role(source: Layout, destination: Layout) -> LayoutOf:
    """A ``layout_of`` for jobs whose layouts every rank knows whole: trainers plan with
    ``source``, inference ranks with ``destination`` (whatever the fingerprints say)."""
    def layout_of(record: MemberRecord, fingerprint: str) -> Layout:
        return source if record.role == "trainer" else destination
    return layout_of


FormatsOf = Callable[[MemberRecord, str], TensorFormats]
"""``formats_of(record, fingerprint)``: the destination formats a member's description
declares (empty for trainers and for inference sides that hold their tensors as they are)."""


def _describe_formats(formats: TensorFormats) -> str:
    if not formats:
        return "bf16 throughout"
    by_format: dict[str, list[str]] = {}
    for name, fmt in formats.entries:
        by_format.setdefault(fmt.name, []).append(name)
    return ", ".join(f"{name} on {len(tensors)} tensor(s)" for name, tensors in sorted(by_format.items())) \
        + f" (formats {formats.fingerprint})"


def attempt_formats(formats_of: FormatsOf | None, view: MembershipView, attempt: AttemptSpec) -> TensorFormats:
    """The destination formats ``attempt`` plans in: those every inference participant
    (holders and destinations) declares. ``ValueError`` naming two members that declare
    different formats (every inference rank of a job must hold each tensor in one format:
    a holder in FP8 can serve only destinations in the same formats)."""
    if formats_of is None:
        return TensorFormats()
    first: tuple[str, TensorFormats] | None = None
    for member_id in sorted(set(attempt.holders) | set(attempt.destinations)):
        formats = formats_of(view.member(member_id), attempt.layout(member_id))
        if first is None:
            first = (member_id, formats)
        elif formats != first[1]:
            other, theirs = first
            raise ValueError(f"inference members {other!r} and {member_id!r} declare different destination formats "
                             f"({other}: {_describe_formats(theirs)}; {member_id}: {_describe_formats(formats)}): "
                             "every inference rank must hold each tensor in the same format")
    return first[1] if first is not None else TensorFormats()


def format_disagreement(formats_of: FormatsOf | None, view: MembershipView, attempt: AttemptSpec) -> str | None:
    """Why ``attempt``'s inference participants cannot be planned together (the message of
    :func:`attempt_formats`), or ``None``."""
    try:
        attempt_formats(formats_of, view, attempt)
    except ValueError as exc:
        return str(exc)
    return None


def holder_cast(layout_of: LayoutOf, view: MembershipView, attempt: AttemptSpec) -> str | None:
    """Why ``attempt``'s holders cannot send beside its trainers, or ``None``: they hold the
    version in another dtype than the trainers (an inference side in BF16, the trainers in
    FP32: the trainers' bytes are cast on the way, the holders' are already the destination's,
    and one source layout holds each tensor in one dtype)."""
    if not attempt.sources or not attempt.holders:
        return None
    first = attempt.sources[0]
    trainers = layout_of(view.member(first), attempt.layout(first))
    for member_id in attempt.holders:
        casts = source_casts(trainers, layout_of(view.member(member_id), attempt.layout(member_id)))
        if casts:
            name, (theirs, held) = next(iter(sorted(casts.items())))
            return (f"holder {member_id!r} holds version {attempt.version} in {held} where the trainers hold "
                    f"{theirs} ({name!r} and {len(casts) - 1} more): it cannot send beside them, make it a destination")
    return None


def plan_attempt(layout_of: LayoutOf, view: MembershipView, attempt: AttemptSpec,
                 options: PlanOptions | None = None, formats_of: FormatsOf | None = None) -> Plan:
    """The plan of ``attempt`` over the epoch's communicator ranks.

    Each participant contributes its own rows (its ``layout_rank`` in its record) of the
    layout ``layout_of`` gives for it: the sending side is the attempt's sources (training
    layouts) plus its holders (inference layouts), the receiving side its destinations.
    Raises ``ValueError`` when neither a source nor a holder has some destination region
    (the version cannot be completed until one comes back), or when two members claim the
    same rank of one layout.

    ``formats_of`` gives each member's destination formats (``attempt_formats``: inference
    participants must agree). In quantized formats the trainers' BF16 is planned into the
    destination format (``make_plan(..., formats=...)``: each block quantized once, by a
    sender that holds it); holders hold that format already, so a catch-up from holders
    moves their FP8 bytes and scales as they are (``destination_format_layout`` on both
    sides, nothing to quantize), and a refit with holders beside trainers is refused
    (``next_action``'s ``holders_serve`` makes them destinations instead). Likewise holders
    whose dtypes differ from the trainers' (``holder_cast``): a destination in BF16 fed by
    FP32 trainers gets the trainers' bytes cast by their senders (``make_plan``).
    """
    def parts(member_ids: tuple[str, ...]) -> list[tuple[Layout, dict[int, int]]]:
        groups: dict[int, tuple[Layout, dict[int, int], dict[int, str]]] = {}
        for member_id in member_ids:
            record = view.member(member_id)
            if record.layout_rank < 0:
                raise ValueError(f"member {member_id!r} has no layout rank")
            layout = layout_of(record, attempt.layout(member_id))
            _, ranks, owners = groups.setdefault(id(layout), (layout, {}, {}))
            if record.layout_rank in owners:
                raise ValueError(f"members {owners[record.layout_rank]!r} and {member_id!r} both hold rank "
                                 f"{record.layout_rank} of layout {layout.fingerprint}")
            ranks[record.layout_rank] = view.rank_of(member_id)
            owners[record.layout_rank] = member_id
        return [(layout, ranks) for layout, ranks, _ in groups.values()]

    formats = attempt_formats(formats_of, view, attempt)
    mixed = holder_cast(layout_of, view, attempt)
    if mixed is not None:
        raise ValueError(mixed)
    if not formats:
        src = combine_layouts(parts(attempt.sources) + parts(attempt.holders))
        dst = combine_layouts(parts(attempt.destinations))
        return make_plan(src, dst, topology_of(view), options)
    if attempt.sources and attempt.holders:
        raise ValueError(f"holders {list(attempt.holders)} hold version {attempt.version} in FP8 and cannot send "
                         f"beside the trainers (which send BF16 quantized on the way): make them destinations")
    dst = combine_layouts(parts(attempt.destinations))
    if attempt.sources:  # trainers: BF16 quantized on the senders
        return make_plan(combine_layouts(parts(attempt.sources)), dst, topology_of(view), options, formats=formats)
    # Holders only: they hold the destination format, which moves as it is.
    src = destination_format_layout(combine_layouts(parts(attempt.holders)), formats)
    return make_plan(src, destination_format_layout(dst, formats), topology_of(view), options)


def source_layout_disagreement(attempt: AttemptSpec) -> str | None:
    """Why the sources of a refit cannot be planned together, or ``None``: every trainer
    describes the whole training side, so all must have published the version in one
    layout (their replica regions are compared by that layout's indices)."""
    named = {attempt.layout(m) for m in attempt.sources}
    if len(named) <= 1:
        return None
    listed = ", ".join(f"{m} in {attempt.layout(m) or '(none)'}" for m in attempt.sources)
    return (f"the trainers published version {attempt.version} in different layouts ({listed}): every trainer "
            "must describe the same training side")


# ---- giving up on a version -------------------------------------------------------------
def fault_cause(exc: BaseException) -> str:
    """``"Type: first line"`` of ``exc`` (at most 300 characters): a fault's cause as the
    done keys, the ``failed`` record and ``RefitFailed`` carry it."""
    first = brief(exc) if str(exc).strip() else ""
    return (f"{type(exc).__name__}: {first}" if first else type(exc).__name__)[:_CAUSE_CHARS]


def attempt_cause(done: Mapping[str, Done]) -> str | None:
    """Why an attempt failed, from its participants' done values (member id -> value; a
    participant that wrote none is left out), or ``None`` if no participant reported a
    fault of its own.

    The first own fault in member id order that is not a ``TransportAborted`` wins (a rank
    that fails mid-transfer aborts the transport, so its peers report ``TransportAborted``
    as a consequence), else the first ``TransportAborted``. ``aborted`` values never are a
    cause.
    """
    causes = [done[m].cause for m in sorted(done) if done[m].kind is DoneKind.FAILED]
    for cause in causes:
        if not cause.startswith("TransportAborted"):
            return cause
    return causes[0] if causes else None


@dataclass(frozen=True, slots=True)
class FailureTally:
    """``num_attempts`` consecutive attempts of ``version`` failed for ``cause``, all with
    the members ``identities`` ((role, member_id, incarnation) of the epoch's view)."""

    version: int
    cause: str
    num_attempts: int
    identities: frozenset[tuple[str, str, str]]

    def __post_init__(self) -> None:
        if self.num_attempts < 1:
            raise ValueError(f"num_attempts must be >= 1, got {self.num_attempts}")


def count_failure(tally: FailureTally | None, view: MembershipView, version: int, cause: str) -> FailureTally:
    """The tally after an attempt of ``version`` failed for ``cause`` in ``view`` (pure).

    Consecutive failures add up only for the same version, the same cause and the same
    members: a different cause or any membership change (a member left, joined or
    restarted) starts over at 1. An epoch with the same members (a communicator rebuilt
    after a transport fault) keeps counting.
    """
    if (tally is not None and tally.version == version and tally.cause == cause
            and tally.identities == view.identities):
        return replace(tally, num_attempts=tally.num_attempts + 1)
    return FailureTally(version, cause, 1, view.identities)


# A dead member's lease expires within its TTL; the leader then needs a watch event and a
# publish, well under a second on a healthy etcd.
REFORM_GRACE_S = 1.0


def reform_due(broken_for_s: float, ttl_s: float) -> bool:
    """Whether a member whose communicator broke ``broken_for_s`` seconds ago (and that has
    seen no newer epoch since) should ask for a rebuild with the same members (pure).

    Not at once: a broken communicator most often means a dead peer, whose lease expires
    within ``ttl_s``, and the epoch without it can be a shrink of the old communicator. A
    reform epoch asked for before that would rebuild with the dead peer in it and wait for
    it until its lease expired anyway. Only when no such epoch came (the peer is alive: a
    network fault, a stall) is a rebuild with the same members the way forward.
    """
    return reform_due_in(broken_for_s, ttl_s) == 0.0


def reform_due_in(broken_for_s: float, ttl_s: float) -> float:
    """Seconds until :func:`reform_due` turns true (0.0 once it is), pure."""
    if broken_for_s < 0 or ttl_s <= 0:
        raise ValueError(f"broken_for_s must be >= 0 and ttl_s > 0, got {broken_for_s} and {ttl_s}")
    return max(0.0, ttl_s + REFORM_GRACE_S - broken_for_s)
