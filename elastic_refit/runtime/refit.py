"""``ElasticRefit``: the context every trainer and inference rank runs.

Each rank runs an agent thread that follows the job's epochs: its decisions are the pure
state machine of ``runtime.agent`` (``decide``, and ``coordinator_tidy`` / ``coordinate``
for the coordinator); ``_agent_loop`` executes them. Per epoch it reconfigures
the refit communicator (shrink / grow / rebuild, in ``membership``), then works through
the epoch's attempts in order. The epoch's coordinator (its rank 0) proposes each attempt
(a version, its sources, holders and destinations) in etcd, fenced by its lease and the epoch;
participants plan it (pure), agree on the plan's fingerprint, move the bytes, verify them,
and ack. Once every live inference rank holds a version, the coordinator commits it.

Reads come from watches, not etcd: the version state from a ``VersionTracker`` (each key
parsed once, when it lands), attempts and their plan and done keys from the watch of the
epoch's store. An ack is written in one transaction with its done key, so the coordinator
that saw every done key knows the revision its version state must reach before it decides
again. Per version a member writes its plan key and its done key (with the ack) and reads
the plan keys once; the coordinator adds the propose, the commit and the prunes.

A fault (a dead peer, a timeout, a membership change) fails the attempt everywhere; the
next attempt of the same or of the next epoch retries the same version with the
survivors, with the inference ranks that already hold it serving as holders next to the
trainers (the sources).

A deterministic fault (bad input, a bug) would fail every retry: each participant writes
the cause of its own fault into its attempt ``done`` key, the coordinator counts
consecutive failed attempts of a version with the same cause and the same members, and
after ``max_attempts`` it records ``versions/{v}/failed``. Every member that observes the
record raises :class:`~elastic_refit.errors.RefitFailed` (with the cause) to ``publish`` /
``wait_for_version`` callers of that version; later versions still commit.

Inference safety: in ``in_place`` mode a rank stops serving (``weights()`` blocks) from
the moment an update starts writing its parameters until a version it holds commits; in
``staged`` mode updates land in spare buffers and are swapped in under the same lock when
they commit, so serving never stops for a transfer.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from elastic_refit._validate import check_timeout, is_integer
from elastic_refit.errors import (
    RefitError,
    RefitFailed,
    RefitTimeout,
    SourceChanged,
    TransferRefused,
    TransportAborted,
    brief,
)
from elastic_refit.kernels import warm_up
from elastic_refit.layout import Layout, TensorFormats, described_fingerprint
from elastic_refit.log import get_logger
from elastic_refit.membership import (
    CommunicatorError,
    CommunicatorManager,
    EpochTimeout,
    EtcdClient,
    MemberRecord,
    Membership,
    MembershipConfig,
    MembershipError,
    MembershipLost,
    MembershipView,
)
from elastic_refit.membership.client import KeyValue
from elastic_refit.membership.keys import AttemptKeys, connect_key
from elastic_refit.membership.layouts import LayoutStore, LayoutUnavailable
from elastic_refit.membership.store import EtcdStore
from elastic_refit.membership.versions import (
    Commit,
    Failure,
    VersionState,
    VersionStore,
    VersionTracker,
)
from elastic_refit.membership.wakeup import ChangeSignal
from elastic_refit.plan import Plan, PlanOptions, destination_format_layout
from elastic_refit.runtime.agent import (
    Action,
    AgentInputs,
    AgentSettings,
    AgentState,
    AttemptRan,
    AwaitEpoch,
    AwaitMembership,
    Backoff,
    CommunicatorFailed,
    ConnectAhead,
    Connected,
    Entered,
    EnterEpoch,
    Fail,
    Faulted,
    Idle,
    Lost,
    NextAttempt,
    Observe,
    Observed,
    Outcome,
    Propose,
    Refuse,
    RunAttempt,
    coordinate,
    coordinator_tidy,
    decide,
)
from elastic_refit.runtime.attempt import (
    ABORTED,
    DONE_OK,
    FAILED,
    REFIT,
    AttemptSpec,
    CommitAction,
    FailureTally,
    attempt_cause,
    check_publish,
    count_failure,
    fault_cause,
    format_disagreement,
    plan_attempt,
    source_layout_disagreement,
    steady_refit,
)
from elastic_refit.runtime.config import RefitConfig, RefitLayouts
from elastic_refit.runtime.layouts import LayoutCache
from elastic_refit.runtime.phases import NO_HOOKS, PhaseHooks
from elastic_refit.runtime.replicas import (
    ReplicaRegion,
    region_digests,
    replica_disagreement,
    replica_regions,
)
from elastic_refit.transport.agreement import agree_on_plan
from elastic_refit.transport.buffers import (
    buffer_digests,
    buffers_digest,
    combine_digests,
    overlapping,
)
from elastic_refit.transport.connect import connect_ahead, plan_peers
from elastic_refit.transport.executor import Executor, ExecutorOptions
from elastic_refit.transport.protocol import Transport

EventListener = Callable[[str, dict[str, Any]], None]

_VERSIONS_REMEMBERED = 64  # commit and failure records a member keeps (memory flat over a long run)


class _AttemptAborted(RefitError):
    """This rank stopped an attempt because of something outside it (a peer failed it
    first, the epoch moved on, the runtime closes): a consequence, never a cause."""


class _EventLog:
    """A structlog logger that also hands every event to a listener (metrics, tests), so
    events are defined once, where they are logged."""

    def __init__(self, logger: Any, listener: EventListener | None, context: dict[str, Any] | None = None) -> None:
        self._logger = logger
        self._listener = listener
        self._context = context or {}

    def bind(self, **context: Any) -> _EventLog:
        return _EventLog(self._logger.bind(**context), self._listener, {**self._context, **context})

    def _emit(self, level: str, event: str, fields: dict[str, Any]) -> None:
        getattr(self._logger, level)(event, **fields)
        if self._listener is not None:
            with contextlib.suppress(Exception):  # a metrics bug must not break a refit
                self._listener(event, {**self._context, **fields})

    def info(self, event: str, **fields: Any) -> None:
        self._emit("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit("error", event, fields)


class ElasticRefit:
    """Refit that survives failures; use as a context manager on every rank.

    ``layout`` describes this rank's own side (a ``Layout``, e.g. ``from_dtensors(model)``):
    it is published to etcd and the other side's is read from there, so neither side's
    configuration names the other's parallelism. A ``RefitLayouts`` of both sides works too.

    Trainer: ``publish(tensors, version)`` returns once ``version`` committed on every live
    inference rank. Inference: pass ``parameters`` (an ``nn.Module`` whose local shards are
    written in place, or buffer name -> tensor: the layout's buffers of this rank); read them
    inside ``with refit.weights():``. ``update_layout`` changes this rank's layout between
    versions. ``on_event(name, fields)`` receives every runtime event (e.g. ``RefitMetrics``).

    An inference side that serves some tensors quantized declares their ``formats``
    (``TensorFormats``, e.g. ``checkpoint_formats(model, "fp8-block128")``): they travel with
    its layout through etcd, every inference rank must declare the same ones, and its
    ``parameters`` are then the tensors as the engine holds them: ``float8_e4m3fn`` weights
    plus their scales (``weight_scale_inv`` float32 for ``fp8-block128``, ``weight_scale``
    uint8 E8M0 codes for ``mxfp8``), whose shapes ``destination_format_layout(layout,
    formats)`` gives. Trainers publish BF16 as ever; the trainer that sends a block
    quantizes it (once per refit), and only FP8 bytes and scales cross the network.
    """

    def __init__(self, config: RefitConfig, layout: Layout | RefitLayouts, *,
                 parameters: Mapping[str, torch.Tensor] | torch.nn.Module | None = None,
                 formats: TensorFormats | None = None,
                 on_event: EventListener | None = None,
                 hooks: PhaseHooks | None = None) -> None:
        if hooks is not None and not isinstance(hooks, PhaseHooks):
            raise ValueError(f"hooks must be a PhaseHooks, got {type(hooks).__name__}")
        self.config = config
        self._hooks = NO_HOOKS if hooks is None else hooks
        if isinstance(layout, RefitLayouts):
            self._layout = layout.source if config.role == "trainer" else layout.destination
            self._known_layouts: tuple[Layout, ...] = (layout.source, layout.destination)
        elif isinstance(layout, Layout):
            self._layout, self._known_layouts = layout, (layout,)
        else:
            raise ValueError(f"layout must be a Layout (this side's) or RefitLayouts, got {type(layout).__name__}")
        self._check_layout_rank(self._layout)
        self._formats, self._buffer_layout = self._checked_formats(self._layout, formats)
        self._described = described_fingerprint(self._layout, self._formats)
        self.log = _EventLog(get_logger("elastic_refit.runtime"), on_event).bind(
            job=config.job, role=config.role, member_id=config.member_id, incarnation=config.incarnation)
        if config.role == "inference":
            if parameters is None:
                raise ValueError(f"inference member {config.member_id!r} needs its parameters")
            parameters = tensors_of(parameters)
            self._check_parameters(self._buffer_layout, parameters)
        self.parameters: dict[str, torch.Tensor] = dict(parameters or {})
        # Attempts and layout changes take turns (a change waits for the attempt in flight).
        self._attempt_lock = threading.Lock()
        # Staged mode receives into spares and swaps them in on commit.
        self._incoming = ({k: v.clone() for k, v in self.parameters.items()}
                          if config.mode == "staged" else self.parameters)
        self._published: dict[int, tuple[dict[str, torch.Tensor], str]] = {}  # version -> (buffers, layout)
        self._copies: dict[int, int] = {}  # version -> bytes of its snapshot copy (publish(wait=False))
        self._sent: set[int] = set()  # versions this trainer's sends completed for (bounded in _observe)
        self._acked: set[int] = set()  # versions this rank acked and has not retracted since
        self._last_published: tuple[int, str] | None = None  # (version, digest) of this trainer's latest publish
        self._snapshots: dict[int, dict[str, int]] = {}  # version -> buffer digests taken at publish
        self._regions: tuple[str, tuple[ReplicaRegion, ...]] | None = None  # (training layout, its replica regions)
        self._cond = threading.Condition()
        self._readers = 0
        self._blocked = False  # in-place: parameters are being (or were partly) overwritten
        self._serving: int | None = None  # committed version the parameters hold
        self._committed: dict[int, Commit] = {}
        self._failed: dict[int, Failure] = {}  # versions given up (versions/{v}/failed)
        self._last_fault: tuple[float, str] | None = None  # (monotonic time, cause) of this rank's latest fault
        # Coordinator: consecutive failed attempts per version, and the attempt it proposed
        # last that has not been counted yet (view, seq, spec).
        self._tallies: dict[int, FailureTally] = {}
        self._uncounted: tuple[MembershipView, int, AttemptSpec] | None = None
        self._attempts_pruned: tuple[int, int] | None = None  # (epoch, seq) pruned last
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._transport: Transport | None = None  # the current epoch's, used by the agent thread
        self._executors: tuple[tuple[str, int], Executor] | None = None  # see _executor
        # The latest plans (see _plan): a plan depends on the epoch, the participants and
        # their layouts, never on the version.
        self._plans: dict[tuple, Plan] = {}
        self._plans_lock = threading.Lock()
        self.stats: dict[str, Any] = {"attempts": 0, "failed_attempts": 0, "reconfigurations": 0,
                                      "connected_ahead": 0}

    # ---- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> ElasticRefit:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> ElasticRefit:
        c = self.config
        # Gloo connects all pairs while the epoch's communicator is built (bounded by the epoch
        # deadline). Lazy connection (TORCH_GLOO_LAZY_INIT) was tried and rejected: a send to a
        # peer that died before its pair connected blocks inside send() for ~50 s of retries.
        self.client = EtcdClient(c.etcd_config())
        record = MemberRecord(c.role, c.member_id, c.incarnation, c.host, c.domain, c.device,
                              layout_rank=c.layout_rank, layout=self._described)
        self.membership = Membership(self.client, c.job, record, MembershipConfig(
            ttl_s=c.ttl_s, collective_timeout_s=c.collective_timeout_s, epoch_deadline_s=c.epoch_deadline_s))
        self.layout_cache = LayoutCache(LayoutStore(self.client, c.job), self._known_layouts)
        if torch.device(c.device).type == "cuda":
            # Before joining: a newcomer's first refit must not compile the pack kernels.
            t0 = time.perf_counter()
            warm_up(c.device)
            self.log.info("refit.kernels.warmed", seconds=time.perf_counter() - t0)
        self.membership.start()
        # Peers that see the record before this lands find the layout unavailable and wait.
        self.layout_cache.publish(self.membership, self._layout, self._formats)
        self.versions = VersionStore(self.client, c.job)
        # The agent reads version state and its epoch's keys when they change, not on a
        # timer: an idle member costs etcd its keepalive and a few watch streams. The version
        # state is the tracker's, kept from its watch (each key parsed once, when it lands),
        # not read whole from etcd on every wakeup.
        self._changes = ChangeSignal(self.client)
        self.tracker = VersionTracker(self.client, c.job, progress_interval_s=self._changes.progress_interval_s,
                                      stall_timeout_s=self._changes.stall_timeout_s)
        self.tracker.on_change(lambda _reset, _events: self._changes.bump())
        self.tracker.start()
        self._changes.watch("layouts", self.versions.keys.layouts_prefix)  # a peer's layout unblocks a plan
        self.membership.on_view(lambda _old, _new: self._changes.bump())
        self.manager = CommunicatorManager(self.client, c.job, c.member_id, backend=c.backend,
                                           config=self.membership.config, superseded=self._superseded,
                                           latest_view=lambda: self.membership.view,
                                           transport_timeout_s=c.transport_timeout_s, device=c.device,
                                           bind_interface=c.bind_interface)
        if c.bind_interface is not None and c.backend != "gloo":
            os.environ.setdefault("NCCL_SOCKET_IFNAME", c.bind_interface)  # NCCL reads it at init
        self._thread = threading.Thread(target=self._agent, name=f"refit-agent-{c.member_id}", daemon=True)
        self._thread.start()
        self.log.info("refit.member.started", layout_rank=c.layout_rank, mode=c.mode, layout=self._described,
                      num_quantized_tensors=len(self._formats))
        return self

    def _plan_options(self) -> PlanOptions:
        return PlanOptions(bucket_bytes=self.config.bucket_bytes, concurrent_rounds=self.config.concurrent_rounds,
                           relay=self.config.relay)

    def _superseded(self, epoch: int) -> bool:
        latest = self.membership.view
        return latest is not None and latest.epoch > epoch

    def close(self) -> None:
        """Leave the job: stop the agent, revoke the lease (peers see a clean leave)."""
        self._stop.set()
        changes = getattr(self, "_changes", None)
        if changes is not None:
            changes.bump()  # an idle agent waits on it: let it see the stop now
        if self._thread is not None:
            self._thread.join(timeout=self.config.epoch_deadline_s)
        if changes is not None:
            changes.close()
        tracker = getattr(self, "tracker", None)
        if tracker is not None:
            tracker.stop()
        for closer in (getattr(self, "manager", None), getattr(self, "membership", None), getattr(self, "client", None)):
            if closer is not None:
                with contextlib.suppress(Exception):
                    closer.close()
        with self._cond:
            self._cond.notify_all()

    # ---- trainer API -------------------------------------------------------------------
    def publish(self, tensors: Mapping[str, torch.Tensor] | torch.nn.Module, version: int,
                timeout_s: float | None = None, *, wait: bool = True) -> Commit | PublishHandle:
        """Offer ``tensors`` (buffer name -> tensor, or a module's named parameters) as
        ``version`` and block until it commits. The tensors must not change meanwhile.

        With ``wait=False`` return a :class:`PublishHandle` as soon as the tensors may
        change again, so the next training step overlaps the refit: at once when
        ``RefitConfig.snapshot_bytes`` holds a copy of them (taken here, on their device;
        publish waits while earlier versions' copies fill the budget), else once this
        trainer's own sends of the version are done ("hold until sent"). A version that a
        newer one supersedes before it commits is dropped, not queued: its handle resolves
        to the newer commit.

        Raises :class:`RefitFailed` (with the cause) once ``version`` failed
        ``max_attempts`` consecutive attempts for the same cause (e.g. a tensor of the wrong
        shape or a missing buffer on some trainer), and :class:`RefitTimeout` after
        ``timeout_s`` (default ``version_timeout_s``)."""
        me = self.config.member_id
        if self.config.role != "trainer":
            raise ValueError(f"publish is for trainers; {me!r} is {self.config.role}")
        if not is_integer(version) or version < 0:
            raise ValueError(f"version must be an integer >= 0, got {version!r}")
        timeout_s = check_timeout("timeout_s", timeout_s)
        tensors = tensors_of(tensors)
        layout = self._layout
        # The watched state: it holds every commit this trainer's earlier publishes returned.
        state = self.tracker.state()
        # Bad input fails here, in the caller, never as attempts retried until they give up.
        # The version is failed for the whole job too (every live trainer must source it),
        # so peers waiting for it raise at once.
        try:
            self._check_buffers(layout, tensors, f"trainer {me!r}, version {version}: published buffer")
        except ValueError as exc:
            if version not in state.committed and self.versions.refuse(self.membership, version, fault_cause(exc)):
                self.log.error("refit.version.refused", version=version, cause=str(exc))
            raise
        with self._cond:
            self._supersede(version)
        copied = not wait and self.config.snapshot_bytes > 0
        if copied:
            # The copy is what moves (nobody else can write it): digests are taken from it.
            tensors = self._snapshot_copy(tensors, version, timeout_s)
        # Taken before any byte moves: what the version is, whatever the buffers do later.
        snapshot = buffer_digests(tensors)
        data_digest = combine_digests(snapshot)
        repeat = check_publish(version, data_digest, me, state, self._last_published)
        if repeat is not None:
            if copied:
                with self._cond:
                    self._release_copy(version)
            return repeat if wait else PublishHandle(self, version, timeout_s, repeat)
        self._last_published = (version, data_digest)
        regions = (region_digests(layout, self.config.layout_rank, tensors, self._replica_regions(layout),
                                  known=snapshot) if self.config.check_replicas else {})
        with self._cond:
            self._published[version] = (tensors, layout.fingerprint)
            self._snapshots[version] = snapshot
        try:
            self.versions.publish_source(self.membership, version, data_digest, regions, layout.fingerprint)
            self.log.info("refit.version.published", version=version, copied=copied)
        except BaseException:
            with self._cond:
                self._published.pop(version, None)
                self._release_copy(version)
            raise
        handle = PublishHandle(self, version, timeout_s)
        if wait:
            try:
                return handle.wait()
            finally:
                with self._cond:
                    self._published.pop(version, None)
        if not copied:
            # Hold until sent: the caller's tensors are the sources until this trainer's
            # sends of the version are done (or the version is over one way or the other).
            self._wait(lambda: True if (version in self._sent or handle._outcome() is not None) else None,
                       timeout_s, f"version {version} to be sent")
        return handle

    def _snapshot_copy(self, tensors: Mapping[str, torch.Tensor], version: int,
                       timeout_s: float | None) -> dict[str, torch.Tensor]:
        """A private copy of ``tensors`` within ``snapshot_bytes``: waits for room while the
        copies of versions not yet over fill the budget (back-pressure). Older versions'
        copies were dropped already (:meth:`_supersede`); a transfer still reading one keeps
        it alive until it ends, so memory may exceed the budget by that one."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        budget = self.config.snapshot_bytes
        if nbytes > budget:
            raise ValueError(f"trainer {self.config.member_id!r}, version {version}: a snapshot needs {nbytes} "
                             f"bytes, more than snapshot_bytes ({budget})")
        self._wait(lambda: True if sum(self._copies.values()) + nbytes <= budget else None, timeout_s,
                   f"room for the snapshot of version {version} (snapshot_bytes {budget})")
        with self._cond:
            self._copies[version] = nbytes
        return {name: t.detach().clone(memory_format=torch.contiguous_format) for name, t in tensors.items()}

    def _supersede(self, version: int) -> None:
        """(Under ``_cond``.) ``version`` is being published: this trainer's older versions
        are dropped, never queued behind (their buffers, digests and copies)."""
        self._published = {v: t for v, t in self._published.items() if v >= version}
        self._snapshots = {v: d for v, d in self._snapshots.items() if v >= version}
        for v in [v for v in self._copies if v < version]:
            self._release_copy(v)

    def _release_copy(self, version: int) -> None:
        """(Under ``_cond``.) The snapshot of ``version`` is no longer needed: free its budget."""
        if self._copies.pop(version, None) is not None:
            self._published.pop(version, None)
            self._cond.notify_all()

    # ---- layouts ---------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        """This rank's side, as it describes it now."""
        return self._layout

    @property
    def formats(self) -> TensorFormats:
        """The destination formats this rank declared (empty: every tensor as it is)."""
        return self._formats

    def update_layout(self, layout: Layout, parameters: Mapping[str, torch.Tensor] | torch.nn.Module | None = None,
                      timeout_s: float | None = None, *, formats: TensorFormats | None = None) -> None:
        """Describe this rank's side anew between versions (an inference pool re-sharded,
        experts re-placed, a trainer group re-laid out); the next attempt plans against it.

        Inference ranks pass the ``parameters`` that hold the new layout's buffers (default:
        the current ones, which must fit it): from now on this rank holds no version until
        the next one arrives in the new layout, so ``weights()`` blocks until then. A trainer
        may change its layout only while no ``publish`` is in flight. Waits (at most
        ``timeout_s``, default the collective timeout times four) for an attempt this rank is
        in to finish. ``formats`` (inference): the destination formats of the new layout
        (default: the current ones)."""
        if not isinstance(layout, Layout):
            raise ValueError(f"layout must be a Layout, got {type(layout).__name__}")
        timeout_s = check_timeout("timeout_s", timeout_s)
        self._check_layout_rank(layout)
        new_formats, buffer_layout = self._checked_formats(layout, self._formats if formats is None else formats)
        me = self.config.member_id
        new_parameters = None
        if self.config.role == "inference":
            new_parameters = tensors_of(parameters) if parameters is not None else self.parameters
            self._check_parameters(buffer_layout, new_parameters)
        elif parameters is not None:
            raise ValueError(f"trainer {me!r}: parameters are for inference ranks (trainers publish their buffers)")
        wait_s = 4 * self.config.collective_timeout_s if timeout_s is None else timeout_s
        if not self._attempt_lock.acquire(timeout=wait_s):
            raise RefitTimeout("the attempt in flight to finish before the layout change", wait_s, member_id=me)
        try:
            with self._cond:
                if self.config.role == "trainer" and self._published:
                    raise ValueError(f"trainer {me!r}: version(s) {sorted(self._published)} are being published; "
                                     "change the layout between publishes")
            described = described_fingerprint(layout, new_formats)
            if described == self._described and new_parameters is self.parameters:
                return
            fingerprint = self.layout_cache.publish(self.membership, layout, new_formats)
            if self.config.role == "inference":
                # The buffers are about to hold the new layout: nothing this rank acked is held.
                self.versions.retract(self.membership, self.versions.snapshot())
                with self._cond:
                    while self._readers:
                        self._cond.wait(0.05)
                    self.parameters = dict(new_parameters)  # type: ignore[arg-type]
                    self._incoming = ({k: v.clone() for k, v in self.parameters.items()}
                                      if self.config.mode == "staged" else self.parameters)
                    self._serving = None
                    self._cond.notify_all()
            self._layout, self._formats, self._buffer_layout = layout, new_formats, buffer_layout
            self._described = fingerprint
            self.membership.update_record(layout=fingerprint)
            self.log.info("refit.layout.changed", layout=fingerprint, num_pieces=layout.num_pieces,
                          num_buffers=len(layout.buffers(self.config.layout_rank)))
        finally:
            self._attempt_lock.release()

    def _plan_layout(self, record: MemberRecord, fingerprint: str) -> Layout:
        """``plan_attempt``'s ``layout_of``: from the cache, or etcd the first time."""
        return self.layout_cache.layout_of(record, fingerprint)

    def _check_planned_layout(self, spec: AttemptSpec) -> None:
        """The attempt plans this rank with the layout its buffers hold; else it was proposed
        before a layout change reached the coordinator, and nothing may move under it."""
        me = self.config.member_id
        named = spec.layout(me)
        if me in spec.sources:
            with self._cond:
                published = self._published.get(spec.version)
            mine = published[1] if published is not None else named
        else:
            mine = self._described
        if named and named != mine:
            raise _AttemptAborted(f"attempt plans {me} with layout {named}, but it holds layout {mine} now")

    # ---- inference API -----------------------------------------------------------------
    @contextlib.contextmanager
    def weights(self, timeout_s: float | None = None) -> Iterator[int]:
        """Hold the parameters still while reading them; yields the committed version they
        hold. Blocks while an update is applied (and, in place, until it commits)."""
        self._wait(lambda: (self._serving is not None and not self._blocked) or None, timeout_s,
                   "a committed version to serve")
        with self._cond:
            self._readers += 1
            version = self._serving
        try:
            yield version  # type: ignore[misc]
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    def wait_for_version(self, version: int | None = None, timeout_s: float | None = None) -> int:
        """Block until this rank serves a committed version >= ``version`` (any, if None).

        Raises :class:`RefitFailed` if ``version`` failed (and no newer version is served
        yet), :class:`RefitTimeout` after ``timeout_s`` (default ``version_timeout_s``)."""
        want = -1 if version is None else version

        def serving() -> int | None:
            if self._serving is not None and self._serving >= want and not self._blocked:
                return self._serving
            if version is not None:
                self._raise_if_failed(version)
            return None

        what = "any committed version" if version is None else f"version {version} (or newer) to be served"
        return self._wait(serving, timeout_s, what)

    @property
    def serving_version(self) -> int | None:
        return self._serving

    # ---- agent ---------------------------------------------------------------------------
    def _agent(self) -> None:
        try:
            self._agent_loop()
        finally:
            # Frames of this thread may outlive it in a latched error's traceback: they must
            # not keep the communicator (and its sockets) alive after close().
            self._release_transport()

    def _release_transport(self) -> None:
        self._executors = None  # an executor holds its transport
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.close()

    def _agent_loop(self) -> None:
        """The driver of the agent's state machine (:func:`~elastic_refit.runtime.agent.decide`):
        each turn it reads the latest view, lets ``decide`` pick the action, executes it and
        feeds back what came of it. Every decision is there; here are only side effects."""
        settings = AgentSettings.of(self.config)
        state, outcome = AgentState(), None
        lost: MembershipLost | None = None
        changed = self._changes.token()
        while not self._stop.is_set() or isinstance(outcome, Lost):  # a lost membership fails waiters even when closing
            if not isinstance(outcome, Observed):
                # Before any read: a change after it wakes an idle wait. After an Observe the
                # token taken before its reads stays (an older token can only wake sooner).
                changed = self._changes.token()
            action, state = decide(state, AgentInputs(settings, self.membership.view, outcome), time.monotonic())
            if isinstance(action, Fail):
                self.log.error("fault.detected", kind="membership_lost", error=action.reason)
                self._fail(lost if lost is not None else MembershipLost(action.reason))
                return
            try:
                outcome = self._execute(action, state, changed)
            except MembershipLost as exc:
                lost, outcome = exc, Lost(str(exc))
            except Exception as exc:  # a fault outside an attempt: back off until something changes
                self._fault_detected(exc, state.epoch, state.seq)
                outcome = Faulted(fault_cause(exc))

    def _execute(self, action: Action, state: AgentState, changed: int) -> Outcome | None:
        """Carry out one action of the agent in ``state`` (the state ``decide`` left);
        returns what came of it, None after a wait. ``changed``: the change token an idle
        wait waits after."""
        if isinstance(action, AwaitMembership):
            self.membership.check()  # a member whose lease expired is out for good
            self._stop.wait(action.timeout_s)
        elif isinstance(action, AwaitEpoch):
            if action.request_reform:
                self._request_reform(action.after_epoch)
            with contextlib.suppress(EpochTimeout):
                self.membership.wait_for_view(after_epoch=action.after_epoch, timeout_s=action.timeout_s)
        elif isinstance(action, EnterEpoch):
            return self._enter_epoch(action)
        elif isinstance(action, ConnectAhead):
            view = self._entered(state, action.epoch)
            if self._connect_ahead(view, self._transport):  # type: ignore[arg-type]
                return Connected(action.epoch)
            return Connected(action.epoch, broke=True, can_shrink=self._broke(view))
        elif isinstance(action, Observe):
            return self._look_for_attempt(self._entered(state, action.epoch), action)
        elif isinstance(action, RunAttempt):
            view = self._entered(state, action.epoch)
            if self._run_attempt_locked(view, self._transport, action.seq, action.spec):  # type: ignore[arg-type]
                return AttemptRan(action.epoch, action.seq)
            return AttemptRan(action.epoch, action.seq, broke=True, can_shrink=self._broke(view))
        elif isinstance(action, Idle):
            # Nothing to do until a key changes; the timeout only bounds what a lost watch
            # event could cost (the watches resume and relist themselves).
            self._changes.wait_after(changed, action.timeout_s)
        elif isinstance(action, Backoff):
            with contextlib.suppress(Exception):  # a fault while backing off must not stack on the fault
                self.membership.wait_for_view(after_epoch=action.after_epoch, timeout_s=action.timeout_s)
        else:
            raise TypeError(f"the agent has no way to execute {action!r}")
        return None

    @staticmethod
    def _entered(state: AgentState, epoch: int) -> MembershipView:
        if state.view is None or state.view.epoch != epoch:
            raise RefitError(f"agent bug: an action for epoch {epoch} while in epoch {state.epoch}")
        return state.view

    def _enter_epoch(self, action: EnterEpoch) -> Outcome:
        """Reconfigure the communicator from ``action.previous`` to ``action.view`` (shrink /
        grow / rebuild, see ``CommunicatorManager``)."""
        latest = action.view
        self._count_left_attempt(latest)
        self._hook("comm.reconfiguring", epoch=latest.epoch, first=action.previous is None)
        # The manager's watchdog must hold the last reference to the old process group, so
        # that its destructor never runs (and blocks) on this thread.
        self._release_transport()
        try:
            result = self.manager.reconfigure(action.previous, latest, broken=action.broken)
        except CommunicatorError as exc:
            self.log.warning("refit.communicator.broken", epoch=latest.epoch)
            self._fault_detected(exc, None, 0)  # nothing of the old communicator survives
            return CommunicatorFailed(latest.epoch)
        self._transport = self._hooks.wrap_transport(result.transport)
        self._hook("comm.ready", epoch=latest.epoch, rank=result.rank, path=result.path)
        # The communicator is formed: the epoch is entered whatever follows (a fault of the
        # watch below costs only wakeups, which the idle timeout bounds).
        try:
            self._changes.watch("epoch", self.versions.keys.store(latest.epoch))
        except Exception as exc:
            self._fault_detected(exc, latest.epoch, 0)
        self.stats["reconfigurations"] += 1
        self.log.info("refit.epoch.entered", epoch=latest.epoch, rank=result.rank, num_ranks=result.num_ranks,
                      path=result.path, seconds=result.seconds)
        del result  # the manager and self._transport keep the only references
        return Entered(latest)

    def _look_for_attempt(self, view: MembershipView, action: Observe) -> Observed:
        """Take in the version state (serve what committed), coordinate as the epoch's rank
        0, then look for attempt ``action.seq`` or a later one. No etcd read unless the
        coordinator moves: the state is the tracker's, the attempts the epoch watch's."""
        state = self.tracker.state()
        self._observe(state)
        if action.coordinate:
            proposed = self._coordinate(view, action.seq, state)
            if proposed is not None:  # no need to wait for the watch to bring it back
                return Observed(action.epoch, proposed)
        found = self._next_attempt(view.epoch, action.seq)
        if found is None:
            return Observed(action.epoch, None)
        seq, record = found
        return Observed(action.epoch, NextAttempt(seq, AttemptSpec.from_json(record)))

    def _epoch_keys(self, epoch: int) -> dict[str, KeyValue] | None:
        """The keys of ``epoch``'s store as its watch holds them (attempts, plan and done
        keys), or None while the watch is not on that epoch (then read etcd)."""
        snap = self._changes.snapshot("epoch", self.versions.keys.store(epoch))
        return snap.items if snap is not None else None

    def _next_attempt(self, epoch: int, seq: int) -> tuple[int, dict[str, Any]] | None:
        """The first attempt of ``epoch`` numbered ``seq`` or later, from the epoch watch
        when it is on the epoch (else etcd)."""
        return self.versions.next_attempt(epoch, seq, known=self._epoch_keys(epoch))

    def _broke(self, view: MembershipView) -> bool:
        """An operation broke this epoch's transport: it cannot be used again. Returns
        whether it can shrink (then the communicator stays with the manager)."""
        self.log.warning("refit.communicator.broken", epoch=view.epoch)
        return self._transport is not None and self._transport.capabilities.can_shrink

    def _fault_detected(self, exc: Exception, epoch: int | None, seq: int) -> None:
        """A fault of the agent outside any attempt: counted, noted for timeouts, logged."""
        self.stats["failed_attempts"] += 1
        self._note_fault(fault_cause(exc))
        self.log.warning("fault.detected", kind=type(exc).__name__, error=brief(exc),
                         epoch=epoch, seq=seq)

    def _plan(self, view: MembershipView, spec: AttemptSpec) -> Plan:
        """``plan_attempt`` of ``spec`` in ``view``, memoised: every refit with the same
        participants in the same places (and the coordinator's feasibility check, and
        connecting ahead) plans once. The key is what a plan reads from a view, not its epoch:
        the retry after a reform (the same members re-forming a communicator a timeout broke)
        reuses the plan instead of paying for it inside the recovery. Plans of other member
        sets are dropped."""
        members = tuple((m.role, m.member_id, m.incarnation, m.layout_rank, m.layout, m.domain, m.host)
                        for m in view.members)
        key = (members, spec.sources, spec.holders, spec.destinations, spec.layouts)
        with self._plans_lock:
            plan = self._plans.get(key)
        if plan is None:
            plan = plan_attempt(self._plan_layout, view, spec, self._plan_options(),
                                formats_of=self.layout_cache.formats_of)
            with self._plans_lock:
                for stale in [k for k in self._plans if k[0] != members]:
                    del self._plans[stale]
                while len(self._plans) >= 4:  # plans of big models are big
                    self._plans.pop(next(iter(self._plans)))
                self._plans[key] = plan
        return plan

    def _executor(self, plan: Plan, transport: Transport) -> Executor:
        """The executor of ``plan`` on ``transport``, kept for the epoch's later refits: its
        schedule is built and its staging allocated once, not per version. Only the latest
        is kept (its staging is memory); it goes with the transport."""
        key = (plan.fingerprint, id(transport))
        if self._executors is None or self._executors[0] != key:
            self._executors = None  # the old staging goes before the new is allocated
            self._executors = (key, Executor(plan, transport, ExecutorOptions(
                staging_bytes=self.config.staging_bytes, verify=self.config.verify)))
        return self._executors[1]

    def _connect_ahead(self, view: MembershipView, transport: Transport) -> bool:
        """On entering an epoch: connect the pairs the epoch's refit plan uses (one byte
        along each direction, then its vote), so the first refit after a reconfiguration
        does not pay NCCL's lazy connection setup (see ``transport.connect``). Every member
        publishes the fingerprint of the plan it would connect, and all connect only when
        all agree; otherwise (a layout not published yet, no refit possible) nobody does.
        Returns False when the transport broke."""
        spec = steady_refit(view)
        if not self.config.connects_ahead or spec is None:
            return True
        me = self.config.member_id
        store = self.manager.store
        log = self.log.bind(epoch=view.epoch)
        t0 = time.perf_counter()
        plan: Plan | None = None
        try:
            plan = self._plan(view, spec)
            mine = plan.fingerprint
        except (LayoutUnavailable, ValueError) as exc:
            mine = f"skip: {fault_cause(exc)}"
        keys = [connect_key(m) for m in spec.participants]
        try:
            store.set(connect_key(me), mine)
            self._wait_keys(store, keys, view.epoch, stage="connecting ahead")
            agreed = all(v.decode() == mine for v in store.multi_get(keys))
        except Exception as exc:  # superseded, closing, etcd: the first refit connects instead
            log.info("refit.connect.skipped", reason=brief(exc))
            return True
        if plan is None or not agreed:
            log.info("refit.connect.skipped", reason=mine if plan is None else "members planned differently")
            return True
        try:
            num_directions = connect_ahead(transport, plan_peers(plan, view.rank_of(me)))
        except TransportAborted as exc:
            log.warning("refit.connect.failed", error=brief(exc))
            return False
        self.stats["connected_ahead"] += 1
        log.info("refit.connect.done", seconds=time.perf_counter() - t0, num_directions=num_directions,
                 fingerprint=plan.fingerprint)
        return True

    def _request_reform(self, epoch: int) -> None:
        """Ask for a new epoch with the same members, unless a newer epoch is already out
        (then it brings a new communicator anyway, e.g. without a dead peer)."""
        if not self._superseded(epoch):
            self.membership.request_reform()

    def _coordinate(self, view: MembershipView, seq: int, state: VersionState) -> NextAttempt | None:
        """Rank 0 of the epoch: commit what is complete, else propose the next attempt (or
        refuse a version whose sources disagree), as ``coordinator_tidy`` and ``coordinate``
        decide. Returns the attempt it proposed, if it did."""
        store = self.manager.store
        pending = self._uncounted
        previous = self._finished_attempt(view, seq - 1) if seq > 0 else None
        tidy = coordinator_tidy(view.epoch, seq, previous_finished=seq == 0 or previous is not None,
                                uncounted=(pending[0].epoch, pending[1]) if pending is not None else None,
                                pruned=self._attempts_pruned, has_store=store is not None)
        if not tidy.proceed:
            return None
        if tidy.count is not None and pending is not None:
            self._uncounted = None
            self._count_attempt(view, pending[1], pending[2], store, view,
                                done=previous[0] if previous is not None and pending[1] == seq - 1 else None)
        if tidy.prune is not None and store is not None:
            self.versions.prune_attempt(view.epoch, tidy.prune, store.prefix)
            self._attempts_pruned = (view.epoch, tidy.prune)
        if tidy.reread and previous is not None:
            state = self._state_including(previous[1])
        self._prune_tallies(state)
        move = coordinate(view, seq, state, feasible=lambda spec: self._feasible(view, spec),
                          disagreement=lambda spec: self._disagreement(view, state, spec),
                          holders_serve=lambda spec: self._holders_serve(view, spec))
        if isinstance(move, Refuse):
            if self.versions.fail(self.membership, move.version, view.epoch, move.cause, 0):
                self.log.error("refit.version.refused", version=move.version, cause=move.reason)
        elif isinstance(move, CommitAction):
            self._hook("commit.before", version=move.version, epoch=view.epoch)
            if self.versions.commit(self.membership, move.version, view.epoch, move.digest):
                self.log.info("refit.version.committed", version=move.version, epoch=view.epoch, digest=move.digest)
                # etcd holds O(ranks) version keys however long the job runs (VersionStore.prune)
                num_versions = self.versions.prune(self.membership, view.epoch, state, move.version)
                if num_versions:
                    self.log.info("refit.versions.pruned", below=move.version, num_versions=num_versions)
        # The proposal is created only if absent (its transaction compares): no read first.
        elif isinstance(move, Propose) and self.versions.propose_attempt(self.membership, view.epoch, move.seq,
                                                                         move.spec.to_json()):
            spec = move.spec
            self._uncounted = (view, move.seq, spec)
            self.log.info("refit.attempt.proposed", epoch=view.epoch, seq=move.seq, version=spec.version,
                          kind=spec.kind, sources=len(spec.sources), holders=len(spec.holders),
                          destinations=len(spec.destinations))
            return NextAttempt(move.seq, spec)
        return None

    def _state_including(self, revision: int) -> VersionState:
        """The tracked version state once it holds etcd ``revision`` (the acks of the attempt
        that just finished: a state without them would propose a redundant catch-up); read
        from etcd if the watch does not bring it within a collective timeout."""
        state = self.tracker.state_at(revision, self.config.collective_timeout_s)
        if state is None:
            self.log.warning("refit.versions.lagging", revision=revision, tracked_revision=self.tracker.revision)
            state = self.versions.snapshot()
        return state

    def _replica_regions(self, layout: Layout) -> tuple[ReplicaRegion, ...]:
        """The replica regions of training layout ``layout`` (memoised for the latest one)."""
        if self._regions is None or self._regions[0] != layout.fingerprint:
            self._regions = (layout.fingerprint, replica_regions(layout))
        return self._regions[1]

    def _format_disagreement(self, view: MembershipView, spec: AttemptSpec) -> str | None:
        """Why the attempt's inference members cannot be planned together (they declare
        different destination formats), or None; None too while a description is not in
        etcd yet (the feasibility check waits for it)."""
        try:
            return format_disagreement(self.layout_cache.formats_of, view, spec)
        except LayoutUnavailable:
            return None

    def _disagreement(self, view: MembershipView, state: VersionState, spec: AttemptSpec) -> str | None:
        """Why a new version is refused before any attempt: inference members that declare
        different destination formats, or (``check_replicas``) sources that disagree."""
        where = self._format_disagreement(view, spec)
        if where is None and self.config.check_replicas:
            where = self._replica_disagreement(view, state, spec)
        return where

    def _holders_serve(self, view: MembershipView, spec: AttemptSpec) -> bool:
        """Whether the holders of a refit can send beside its trainers: not when they hold
        a quantized destination format (they then receive the version again)."""
        try:
            return not any(self.layout_cache.formats_of(view.member(m), spec.layout(m)) for m in spec.holders)
        except LayoutUnavailable:
            return True  # the feasibility check waits for the description

    def _replica_disagreement(self, view: MembershipView, state: VersionState, spec: AttemptSpec) -> str | None:
        """Where the attempt's sources, as published, differ on a region they share (or on
        the layout they published it in)."""
        disagreement = source_layout_disagreement(spec)
        if disagreement is not None or not spec.sources:
            return disagreement
        first = spec.sources[0]
        regions = self._replica_regions(self._plan_layout(view.member(first), spec.layout(first)))
        if not regions:
            return None
        published = state.source_regions.get(spec.version, {})
        ranks = {view.member(m).layout_rank: m for m in spec.sources}
        digests = {rank: published[m] for rank, m in ranks.items() if m in published}
        return replica_disagreement(regions, digests, ranks)

    # ---- giving up on a version (coordinator) ---------------------------------------------
    def _count_attempt(self, view: MembershipView, seq: int, spec: AttemptSpec, store: EtcdStore | None,
                       current: MembershipView, done: Mapping[str, str] | None = None) -> None:
        """Count attempt ``seq`` of ``view``'s epoch from its participants' done values
        (``done`` when read already, else read here); give ``spec.version`` up once
        ``max_attempts`` consecutive attempts failed for one cause. ``current`` is the epoch
        the ``failed`` record is written under (fenced).

        Best effort: a fault while counting (etcd) loses one count, never the agent's place
        in the epoch's attempts."""
        try:
            self._count_attempt_once(view, seq, spec, store, current, done)
        except MembershipLost:
            raise
        except Exception as exc:
            self.log.warning("fault.detected", kind=type(exc).__name__, epoch=view.epoch, seq=seq,
                             error=brief(exc))

    def _count_attempt_once(self, view: MembershipView, seq: int, spec: AttemptSpec, store: EtcdStore | None,
                            current: MembershipView, done: Mapping[str, str] | None) -> None:
        if store is None or store.epoch != view.epoch:
            return
        if done is None:
            done = {m: kv.value.decode() for m, kv in self._read_done(store, seq, spec.participants).items()}
        if len(done) == len(spec.participants) and all(v == DONE_OK for v in done.values()):
            self._tallies.pop(spec.version, None)
            return
        cause = attempt_cause(done)
        if cause is None:  # every failure was a consequence (the epoch moved on, etcd, a lease)
            return
        tally = count_failure(self._tallies.get(spec.version), view, spec.version, cause)
        self._tallies[spec.version] = tally
        if tally.num_attempts < self.config.max_attempts:
            return
        if self.versions.fail(self.membership, spec.version, current.epoch, cause, tally.num_attempts):
            self._tallies.pop(spec.version, None)
            self.log.error("refit.version.failed", version=spec.version, epoch=current.epoch, seq=seq,
                           kind=spec.kind, cause=cause, num_attempts=tally.num_attempts)

    def _count_left_attempt(self, latest: MembershipView) -> None:
        """Entering ``latest``: count the last attempt of the epoch this coordinator leaves,
        if it failed (a transport fault breaks the communicator, so the attempt that hit it
        is the epoch's last). Only across an epoch with the same members (a rebuild): when
        a member left, joined or restarted, the membership change explains the failure."""
        pending = self._uncounted
        if pending is None or pending[0].epoch == latest.epoch:
            return
        self._uncounted = None
        old, seq, spec = pending
        if old.identities != latest.identities or latest.members[0].member_id != self.config.member_id:
            return
        store = self.manager.store  # still the old epoch's: the manager has not reconfigured yet
        if store is None or store.epoch != old.epoch:
            return
        # Every participant is alive (same members): each writes its done key once its part
        # of the attempt failed, within a transfer timeout.
        keys = [AttemptKeys(seq).done(m) for m in spec.participants]
        deadline = time.monotonic() + self.config.ttl_s + 1.0
        with contextlib.suppress(Exception):  # counting is best effort (see _count_attempt)
            while not store.check(keys) and time.monotonic() < deadline and not self._stop.is_set():
                time.sleep(self.config.poll_s)
        self._count_attempt(old, seq, spec, store, latest)

    def _read_done(self, store: EtcdStore, seq: int, participants: tuple[str, ...],
                   known: Mapping[str, KeyValue] | None = None) -> dict[str, KeyValue]:
        """Participant -> its done key of attempt ``seq``, for those that wrote one (one
        read; none with ``known``, the epoch watch's keys)."""
        keys = {member_id: AttemptKeys(seq).done(member_id) for member_id in participants}
        found = store.read(list(keys.values()), known)
        return {member_id: found[key] for member_id, key in keys.items() if key in found}

    def _prune_tallies(self, state: VersionState) -> None:
        latest = state.latest_committed
        for version in [v for v in self._tallies if v in state.failed or (latest is not None and v <= latest)]:
            del self._tallies[version]

    def _feasible(self, view: MembershipView, spec: AttemptSpec) -> bool:
        """Whether live members hold every byte ``spec`` needs (memoised per epoch)."""
        key = (view.epoch, spec)
        cache = self.__dict__.setdefault("_feasibility", {})
        if spec.kind == REFIT and self._format_disagreement(view, spec) is not None:
            return True  # nothing can be planned, and the coordinator refuses the version (_disagreement)
        if key not in cache:
            try:
                self._plan(view, spec)
                cache[key] = True
            except LayoutUnavailable as exc:  # not published yet, or gone: ask again next time
                self.log.warning("refit.layout.unavailable", version=spec.version, epoch=view.epoch,
                                 reason=brief(exc))
                return False
            except ValueError as exc:
                cache[key] = False
                self.log.warning("refit.version.unavailable", version=spec.version, kind=spec.kind,
                                 epoch=view.epoch, reason=brief(exc))
            if len(cache) > 64:
                cache.pop(next(iter(cache)))
        return cache[key]

    def _finished_attempt(self, view: MembershipView, seq: int) -> tuple[dict[str, str], int] | None:
        """Attempt ``seq`` of the epoch is over (absent, or every participant wrote its done
        key): the done values and the etcd revision that the version state must include to
        hold the acks of its destinations (written with their done keys; 0: none). None
        while a participant is still in it. Read from the epoch watch when it is on the epoch."""
        known = self._epoch_keys(view.epoch)
        record = self.versions.attempt(view.epoch, seq, known)
        if record is None:
            return {}, 0
        store = self.manager.store
        if store is None:
            return None
        spec = AttemptSpec.from_json(record)
        done = self._read_done(store, seq, spec.participants, known)
        if len(done) < len(spec.participants):
            return None
        revision = max((kv.mod_revision for m, kv in done.items()
                        if m in spec.destinations and kv.value.decode() == DONE_OK), default=0)
        return {m: kv.value.decode() for m, kv in done.items()}, revision

    def _run_attempt_locked(self, view: MembershipView, transport: Transport, seq: int, spec: AttemptSpec) -> bool:
        with self._attempt_lock:  # a layout change waits for the attempt (and vice versa)
            return self._run_attempt(view, transport, seq, spec)

    def _run_attempt(self, view: MembershipView, transport: Transport, seq: int, spec: AttemptSpec) -> bool:
        """Run one attempt; False when it broke the epoch's communicator (a transport
        fault: gloo closes a pair for good once it times out or its peer resets it)."""
        me = self.config.member_id
        store = self.manager.store
        log = self.log.bind(epoch=view.epoch, seq=seq, version=spec.version, kind=spec.kind)
        self.stats["attempts"] += 1
        planned = False
        moving = False  # agreed and not yet through the transfer: the peers depend on this rank
        try:
            self._hook("attempt.start", epoch=view.epoch, seq=seq, version=spec.version)
            t0 = time.perf_counter()
            self._check_planned_layout(spec)
            plan = self._plan(view, spec)
            s = plan.stats
            log.info("refit.plan.built", seconds=time.perf_counter() - t0, fingerprint=plan.fingerprint,
                     cross_domain_bytes=s.cross_domain_bytes, lower_bound_bytes=s.lower_bound_bytes,
                     intra_domain_bytes=s.intra_domain_bytes, gather_broadcast_bytes=s.gather_broadcast_bytes)
            # Everything this rank can get wrong on its own (its buffers, its staging budget)
            # is checked before it agrees: a fault here fails the agreement, peers stop at once
            # and no byte moves (the communicator stays usable for the retry).
            source, destination = self._buffers(spec)
            executor = self._executor(plan, transport)
            def refused(member_id: str, value: str) -> None:
                if value.startswith((FAILED, ABORTED)):
                    raise _AttemptAborted(f"{member_id} failed attempt {seq} of version {spec.version} before "
                                          f"the plan was agreed ({value})")

            planned = True  # from here on the plan key is written (by the agreement)
            agree_on_plan(store, plan.fingerprint, me=me, participants=spec.participants, key=AttemptKeys(seq).plan,
                          wait=lambda keys: self._wait_keys(store, keys, view.epoch), refused=refused)
            moving = True
            log.info("refit.plan.agreed", participants=len(spec.participants))
            self._hook("plan.agreed", epoch=view.epoch, seq=seq, version=spec.version)
            if me in spec.destinations:
                self._begin_apply()
                # From here on this rank's buffers are being overwritten: it holds nothing.
                # Its own latest acks may not be in the watched state yet: they are named.
                self.versions.retract(self.membership, self.tracker.state(), also=self._acked)
                self._acked.clear()
            self._hook("transfer.before", epoch=view.epoch, seq=seq, version=spec.version,
                       executor=executor, transport=transport)
            with self._cond:
                private = spec.version in self._copies  # publish's own copy: nobody else writes it
            # A source checks its buffers against publish's digests before the closing vote:
            # the vote passing tells every destination that no source changed under its
            # sends (no extra round trip), and the check runs while the receivers finish.
            check = self.config.verify and me in spec.sources and not private

            def transferred() -> None:
                nonlocal moving
                moving = False  # this rank's bytes are through: the executor votes either way
                if check:
                    self._check_unchanged(spec.version, source)

            report = executor.run(source, destination, before_vote=transferred)
            if me in spec.sources:
                with self._cond:
                    self._sent.add(spec.version)
                    self._cond.notify_all()
            log.info("refit.transfer.done", seconds=report.seconds, network_recv_bytes=report.network_recv_bytes,
                     network_send_bytes=report.network_send_bytes, intra_recv_bytes=report.intra_recv_bytes,
                     local_bytes=report.local_bytes, num_verified_boxes=report.num_verified_boxes)
            done = AttemptKeys(seq).done(me)
            if me in spec.destinations:
                self._hook("ack.before", epoch=view.epoch, seq=seq, version=spec.version)
                value = self._digest()
                # One transaction: the coordinator that sees the done key knows the ack's
                # revision, which its watched version state then waits for.
                self.versions.ack(self.membership, spec.version, view.epoch, value,
                                  done=(store.etcd_key(done), DONE_OK.encode()))
                self._acked.add(spec.version)
                log.info("refit.version.acked", digest=value)
            else:
                store.set(done, DONE_OK)
            return True
        except Exception as exc:  # any fault (or bug) fails this attempt, not the agent
            self.stats["failed_attempts"] += 1
            # A fault of this rank's own is a cause the coordinator counts; a consequence of
            # something outside the attempt (a peer failed first, the epoch moved on, etcd or
            # the lease) is not: retrying with the same members may well succeed.
            aborted = isinstance(exc, _AttemptAborted | MembershipError | MembershipLost | TransferRefused)
            cause = fault_cause(exc)
            self._note_fault(brief(exc) if isinstance(exc, _AttemptAborted) else cause)
            log.warning("refit.attempt.failed", error_type=type(exc).__name__,
                        error=brief(exc), aborted=aborted)
            value = (ABORTED if aborted else FAILED) + cause
            with contextlib.suppress(Exception):
                if moving and not transport.aborted:
                    # The peers are moving bytes with this rank: abort, so they fail now
                    # instead of at the transfer timeout (the executor does the same).
                    transport.abort()
                if not planned:  # peers waiting for this rank's plan fail now, not at the deadline
                    store.set(AttemptKeys(seq).plan(me), value)
                store.set(AttemptKeys(seq).done(me), value)
            if isinstance(exc, MembershipLost):
                raise
            if isinstance(exc, TransportAborted) and exc.peer is not None and 0 <= exc.peer < view.num_ranks:
                # A reset or closed connection is evidence the peer died: suspect it now
                # (it refutes if alive) instead of waiting for its lease to expire.
                peer = view.members[exc.peer]
                with contextlib.suppress(Exception):
                    self.membership.report_peer_failure(peer.member_id, peer.incarnation, str(exc))
            if (isinstance(exc, TransportAborted) and not isinstance(exc, TransferRefused)) or transport.aborted:
                return False
            # The communicator is fine (etcd hiccup, plan disagreement, superseded epoch):
            # back off briefly, then the next attempt (or epoch) retries.
            with contextlib.suppress(Exception):
                self.membership.wait_for_view(after_epoch=view.epoch, timeout_s=10 * self.config.poll_s)
            return True

    def _wait_keys(self, store, keys: list[str], epoch: int, stage: str = "the plan was agreed") -> None:
        """Wait for every participant's key, but give up as soon as a newer epoch exists
        (a participant that moved on will never write its key here)."""
        deadline = time.monotonic() + self.config.epoch_deadline_s
        while True:
            changed = self._changes.token()  # the epoch's store is watched: a key written wakes us
            # The watch's copy, not a read: the key that woke us is in it.
            known = self._epoch_keys(epoch) if store.epoch == epoch else None
            if len(store.read(keys, known)) == len(set(keys)):
                return
            latest = self.membership.view
            if latest is not None and latest.epoch != epoch:
                raise _AttemptAborted(f"epoch {epoch} was superseded by epoch {latest.epoch} before {stage}")
            if self._stop.is_set():
                raise _AttemptAborted(f"closing before {stage}")
            if time.monotonic() > deadline:
                raise RefitError(f"participants did not agree on a plan within {self.config.epoch_deadline_s} s"
                                 if stage == "the plan was agreed" else
                                 f"{stage} did not happen within {self.config.epoch_deadline_s} s")
            self._changes.wait_after(changed, min(self.config.idle_wake_s, max(0.0, deadline - time.monotonic())))

    def _check_unchanged(self, version: int, source: Mapping[str, torch.Tensor]) -> None:
        """After this trainer's sends: its buffers still hold what was published as
        ``version``. Else the version is refused for the job (a retry would send the same
        moving target) and :class:`SourceChanged` names the buffers."""
        with self._cond:
            snapshot = self._snapshots.get(version)
        if snapshot is None:
            return
        now = buffer_digests(source)
        changed = sorted(name for name, d in snapshot.items() if now.get(name) != d)
        if changed:
            exc = SourceChanged(f"trainer {self.config.member_id!r}: published buffers {changed} changed while "
                                f"version {version} was in flight; it is refused, publish a new version once "
                                "they hold still")
            self.versions.refuse(self.membership, version, fault_cause(exc))
            raise exc

    def _buffers(self, spec: AttemptSpec) -> tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]:
        me = self.config.member_id
        if me in spec.sources:
            with self._cond:
                published = self._published.get(spec.version)
            if published is None:
                raise RefitError(f"{me} was listed as a source of version {spec.version} but does not hold it")
            return published[0], {}  # checked against the layout in publish
        if me in spec.holders:
            return self._incoming, {}
        return {}, self._incoming

    # ---- version bookkeeping -------------------------------------------------------------
    def _observe(self, state: VersionState) -> None:
        """Track commits and failed versions; serve a committed version once this rank holds it."""
        with self._cond:
            self._committed.update(state.committed)
            self._failed.update(state.failed)
            # Bounded like etcd's version state: a waiter of an older version sees a newer
            # commit (committed "at least"), long after it could have seen its own record.
            for seen in (self._committed, self._failed):
                for v in sorted(seen)[:-_VERSIONS_REMEMBERED]:
                    del seen[v]
            latest_done = max([*self._committed, *self._failed], default=-1)
            for v in [v for v in self._copies if v <= latest_done]:
                self._release_copy(v)  # committed, failed, or superseded by a later commit
            self._sent = {v for v in self._sent if v > latest_done}
            latest = state.latest_committed
            me = self.config.member_id
            ack = state.acks.get(latest, {}).get(me) if latest is not None else None
            holds_latest = (ack is not None and ack.incarnation == self.config.incarnation
                            and ack.layout == self._described)
            if self.config.role == "inference" and holds_latest and self._serving != latest:
                if self.config.mode == "staged":
                    while self._readers:  # swap only between reads
                        self._cond.wait(0.05)
                    for name, tensor in self.parameters.items():
                        tensor.copy_(self._incoming[name])
                self._serving, self._blocked = latest, False
                self.log.info("refit.version.serving", version=latest)
            self._cond.notify_all()

    def _begin_apply(self) -> None:
        """In place, writing the parameters starts: stop new reads, wait for current ones."""
        if self.config.mode != "in_place":
            return
        with self._cond:
            self._blocked = True
            while self._readers:
                self._cond.wait(0.05)

    def _committed_at_least(self, version: int) -> Commit | None:
        done = [c for v, c in self._committed.items() if v >= version]
        return min(done, key=lambda c: c.version) if done else None

    def _digest(self) -> str:
        return buffers_digest(self._incoming)

    def _raise_if_failed(self, version: int) -> None:
        failure = self._failed.get(version)
        if failure is not None:
            raise RefitFailed(failure.version, failure.cause, failure.num_attempts, epoch=failure.epoch)

    def _note_fault(self, cause: str) -> None:
        self._last_fault = (time.monotonic(), cause)

    def _wait(self, ready: Callable[[], Any], timeout_s: float | None, what: str) -> Any:
        """``ready()`` once it is not None (it may raise, e.g. ``RefitFailed``), else
        ``RefitTimeout`` naming ``what`` and this rank's latest fault."""
        timeout_s = self.config.version_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._error is not None:
                    raise self._error
                value = ready()
                if value is not None:
                    return value
                if self._stop.is_set():
                    raise RefitError(f"{self.config.member_id}: closed while waiting for {what}")
                left = deadline - time.monotonic()
                if left <= 0:
                    last = None
                    if self._last_fault is not None:
                        at, cause = self._last_fault
                        last = f"{cause} ({time.monotonic() - at:.1f} s ago)"
                    raise RefitTimeout(what, timeout_s, member_id=self.config.member_id, last_failure=last)
                self._cond.wait(min(left, 0.1))

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            self._error = exc
            self._cond.notify_all()

    def _hook(self, phase: str, **context: Any) -> None:
        self._hooks.fire(phase, {"member_id": self.config.member_id, "role": self.config.role, **context})

    def _check_parameters(self, layout: Layout, parameters: Mapping[str, torch.Tensor]) -> None:
        self._check_buffers(layout, parameters, f"inference rank {self.config.member_id!r}: parameter")

    def _checked_formats(self, layout: Layout, formats: TensorFormats | None) -> tuple[TensorFormats, Layout]:
        """``formats`` (None: none) checked against ``layout``, and the layout of this
        side's buffers in them (``layout`` itself without quantized tensors); ``ValueError``
        naming the tensor, or for formats on a trainer."""
        formats = TensorFormats() if formats is None else formats
        if not isinstance(formats, TensorFormats):
            raise ValueError(f"formats must be a TensorFormats, got {type(formats).__name__}")
        if not formats:
            return formats, layout
        if self.config.role != "inference":
            raise ValueError(f"trainer {self.config.member_id!r}: formats are declared by inference ranks "
                             "(trainers publish their tensors as they are)")
        try:
            return formats, destination_format_layout(layout, formats)
        except ValueError as exc:
            raise ValueError(f"inference rank {self.config.member_id!r}: {exc}") from None

    def _format_note(self, layout: Layout, buffer: str) -> str:
        """What a buffer of a quantized tensor is, for error messages ("" for the others):
        ``layout`` is the layout of this rank's buffers (in its formats)."""
        dtypes = {b.name: b.dtype for b in layout.buffers(self.config.layout_rank)}
        if dtypes.get(buffer) == "float8_e4m3fn":
            return " (FP8 weights: a tensor declared in formats)"
        for suffix in ("_scale_inv", "_scale"):
            base = buffer.removesuffix(suffix)
            if base != buffer and dtypes.get(base) == "float8_e4m3fn":
                return f" (the scales of FP8 buffer {base!r}, one per block)"
        return ""

    def _check_layout_rank(self, layout: Layout) -> None:
        if self.config.layout_rank not in layout.ranks:
            raise ValueError(f"{self.config.role} {self.config.member_id!r} has layout rank {self.config.layout_rank}, "
                             f"which holds nothing in its layout (ranks {_describe_ranks(layout.ranks)})")

    def _check_buffers(self, layout: Layout, tensors: Mapping[str, torch.Tensor], what: str) -> None:
        """Every buffer of this rank in ``layout`` is in ``tensors``, contiguous, with the
        layout's shape and dtype, on this rank's device type, none unknown to the layout and
        no two sharing memory; else ``ValueError`` starting with ``what``."""
        device_type = torch.device(self.config.device).type
        expected = layout.buffers(self.config.layout_rank)
        missing = [b.name for b in expected if b.name not in tensors]
        unknown = sorted(set(tensors) - {b.name for b in expected})
        if missing:
            # Everything that does not match, at once: a module's names vs the layout's.
            listed = f"{what} {missing[0]!r} is missing" if len(missing) == 1 else f"{what}s {missing} are missing"
            extra = f"; {unknown} are not in the layout of rank {self.config.layout_rank}" if unknown else ""
            raise ValueError(listed + extra)
        for buffer in expected:
            t = tensors[buffer.name]
            if tuple(t.shape) != buffer.shape or str(t.dtype).removeprefix("torch.") != buffer.dtype:
                raise ValueError(f"{what} {buffer.name!r} is {list(t.shape)} {t.dtype}, the layout says "
                                 f"{list(buffer.shape)} {buffer.dtype}{self._format_note(layout, buffer.name)}")
            if not t.is_contiguous():
                raise ValueError(f"{what} {buffer.name!r} must be contiguous")
            if t.device.type != device_type:
                raise ValueError(f"{what} {buffer.name!r} is on {t.device}, this rank refits on {self.config.device}")
        if unknown:
            raise ValueError(f"{what}s {unknown} are not in the layout of rank {self.config.layout_rank}")
        shared = overlapping(tensors)
        if shared is not None:
            raise ValueError(f"{what}s {shared[0]!r} and {shared[1]!r} share memory: each buffer needs its own")


class PublishHandle:
    """What ``ElasticRefit.publish(..., wait=False)`` returns: the version's way to its commit.

    ``done()`` says whether it is over; ``wait(timeout_s)`` (and ``result()``) returns its
    :class:`~elastic_refit.membership.versions.Commit`, which is a later version's when a
    newer one superseded it, or raises what ``publish`` would (``RefitFailed``,
    ``RefitTimeout``)."""

    def __init__(self, refit: ElasticRefit, version: int, timeout_s: float | None,
                 commit: Commit | None = None) -> None:
        self.version = version
        self._refit = refit
        self._timeout_s = timeout_s
        self._commit = commit

    def _outcome(self) -> Commit | None:
        """(Under the refit's lock.) The commit, or raise the failure; None while pending."""
        if self._commit is None:
            self._refit._raise_if_failed(self.version)
            self._commit = self._refit._committed_at_least(self.version)
        return self._commit

    def done(self) -> bool:
        with self._refit._cond:
            try:
                return self._outcome() is not None
            except RefitFailed:
                return True

    def wait(self, timeout_s: float | None = None) -> Commit:
        timeout_s = check_timeout("timeout_s", timeout_s)
        return self._refit._wait(self._outcome, self._timeout_s if timeout_s is None else timeout_s,
                                 f"version {self.version} to commit")

    def result(self) -> Commit:
        return self.wait()

    def __repr__(self) -> str:
        return f"PublishHandle(version={self.version}, done={self.done()})"


def tensors_of(tensors: Mapping[str, torch.Tensor] | torch.nn.Module) -> dict[str, torch.Tensor]:
    """Buffer name -> tensor from a module (its named parameters) or a mapping (a state
    dict); DTensors give their local shards (views: writes land in the parameter). The
    layout checks (shape, contiguity, ...) come after, with the rank's name in the error."""
    # No DTensor exists unless its module was imported: importing it here would cost a
    # second (a restarted rank would rejoin that much later).
    DTensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)

    if isinstance(tensors, torch.nn.Module):
        items = list(tensors.named_parameters())
    elif isinstance(tensors, Mapping):
        items = list(tensors.items())
    else:
        raise ValueError(f"expected an nn.Module or a mapping of buffer name -> tensor, got {type(tensors).__name__}")
    out: dict[str, torch.Tensor] = {}
    for name, value in items:
        if DTensor is not None and isinstance(value, DTensor):
            with torch.no_grad():
                value = value.to_local()
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name!r} is a {type(value).__name__}, not a tensor")
        out[name] = value.detach()
    return out


def _describe_ranks(ranks: tuple[int, ...]) -> str:
    if not ranks:
        return "none"
    if len(ranks) == 1:
        return str(ranks[0])
    return f"{ranks[0]}..{ranks[-1]}" if list(ranks) == list(range(ranks[0], ranks[-1] + 1)) else str(list(ranks))
