"""``ElasticRefit``: the context every trainer and inference rank runs, a thin front.

Behind it, each part owns its state and its lock (DESIGN.md, "The runtime's parts"):

- the **driver** (``runtime.driver``): the agent thread, ``decide`` -> execute; it owns the
  epoch's transport and executor;
- the **coordinator** (``runtime.coordinator``): rank 0's tidy / propose / count / commit;
- the **participant** (``runtime.participant``): one attempt, phase by phase;
- the trainer's **published versions** (``runtime.published``);
- the inference rank's **serving slot** (``runtime.serving``);
- the **outcomes** (``runtime.outcomes``): where ``publish``, ``PublishHandle.wait``,
  ``wait_for_version`` and ``weights`` wait, on a condition.

The way of a version: ``publish`` checks the tensors, takes their digests and adds them to
the published versions (``PublishedVersions.add``), then records the source in etcd; the
driver's coordinator proposes an attempt, the driver hands it to
``Participant.run``, which takes the tensors back from ``PublishedVersions.get`` and gives
them to ``Executor.run``, whose sends move them. The commit the coordinator writes reaches
every member through the version tracker; the driver records it in the outcomes, where the
publisher waits.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace

import torch

from elastic_refit._validate import check_timeout, is_integer
from elastic_refit.errors import MembershipLost, RefitError, RefitTimeout
from elastic_refit.kernels import warm_up
from elastic_refit.layout import Layout, TensorFormats
from elastic_refit.log import get_logger
from elastic_refit.membership import EtcdClient, MemberRecord, Membership
from elastic_refit.membership.attempts import AttemptLedger
from elastic_refit.membership.layouts import LayoutStore
from elastic_refit.membership.versions import Commit, VersionStore, VersionTracker
from elastic_refit.membership.wakeup import ChangeSignal
from elastic_refit.runtime.attempt import check_publish, fault_cause
from elastic_refit.runtime.checks import Side, check_buffers, side_of, tensors_of
from elastic_refit.runtime.config import RefitConfig, RefitLayouts
from elastic_refit.runtime.driver import Driver
from elastic_refit.runtime.events import EventListener, EventLog
from elastic_refit.runtime.layouts import LayoutCache
from elastic_refit.runtime.outcomes import Outcomes, PublishHandle
from elastic_refit.runtime.participant import Participant
from elastic_refit.runtime.phases import NO_HOOKS, PhaseHooks
from elastic_refit.runtime.planning import AttemptPlanner
from elastic_refit.runtime.published import Published, PublishedVersions
from elastic_refit.runtime.rejoin import Detachment, communicator_manager
from elastic_refit.runtime.replicas import region_digests
from elastic_refit.runtime.services import Services
from elastic_refit.runtime.serving import ServedVersion, ServingSlot
from elastic_refit.transport.buffers import buffer_digests, combine_digests

__all__ = ["ElasticRefit", "PublishHandle", "tensors_of"]


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

    ``hooks`` (``PhaseHooks``): called at the runtime's named phases, and wrapping every
    epoch's transport; the testing toolkit's ``fault_hooks`` injects faults through them.
    The default does nothing.
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
            own = layout.source if config.role == "trainer" else layout.destination
            self._known_layouts: tuple[Layout, ...] = (layout.source, layout.destination)
        elif isinstance(layout, Layout):
            own, self._known_layouts = layout, (layout,)
        else:
            raise ValueError(f"layout must be a Layout (this side's) or RefitLayouts, got {type(layout).__name__}")
        self._side = self._side_of(own, formats)
        self.log = EventLog(get_logger("elastic_refit.runtime"), on_event).bind(
            job=config.job, role=config.role, member_id=config.member_id, incarnation=config.incarnation)
        self._outcomes = Outcomes(config.member_id)
        self._published: PublishedVersions | None = None
        self._serving: ServingSlot | None = None
        if config.role == "inference":
            if parameters is None:
                raise ValueError(f"inference member {config.member_id!r} needs its parameters")
            parameters = tensors_of(parameters)
            self._check_buffers(self._side.buffer_layout, parameters, f"inference rank {config.member_id!r}: parameter")
            self._serving = ServingSlot(parameters, staged=config.versions.mode == "staged", outcomes=self._outcomes,
                                        log=self.log)
        else:
            self._published = PublishedVersions(config.versions.snapshot_bytes, self._outcomes,
                                                base_bytes=config.transfer.delta_base_bytes)
        self._stop = threading.Event()
        self._running: _Running | None = None  # the parts, once started
        self._detachment = Detachment(self._outcomes)  # see detached
        self._closers: list[Callable[[], object]] = []  # what close() undoes, last first
        self.stats: dict[str, int] = {"attempts": 0, "failed_attempts": 0, "reconfigurations": 0,
                                      "connected_ahead": 0, "warmed_buckets": 0, "one_off_executors": 0}

    # ---- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> ElasticRefit:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> ElasticRefit:
        """Join the job: register, publish this side's layout, start the agent thread."""
        try:
            return self._start()
        except BaseException:
            self.close()  # what was opened before the failure
            raise

    def _start(self) -> ElasticRefit:
        services = self._connect()
        plan = self.config.plan
        planner = AttemptPlanner(services.layouts, plan.options(), self.log, check_replicas=plan.check_replicas)
        participant = Participant(services, planner, self._outcomes, lambda: self._side,
                                  published=self._published, serving=self._serving)
        driver = Driver(services, planner, self._outcomes, participant, lambda: self._side,
                        published=self._published, serving=self._serving, rejoin=self._come_back)
        self._running = _Running(services, planner, participant, driver)
        participant.follow(services.membership)
        self._detachment.follow(services)
        driver.start()
        self.log.info("refit.member.started", layout_rank=self.config.layout_rank, mode=self.config.versions.mode,
                      layout=self._side.described, num_quantized_tensors=len(self._side.formats))
        return self

    def _connect(self) -> Services:
        """Everything this member talks to, connected and watching (see ``Services``)."""
        c = self.config
        # Gloo connects all pairs while the epoch's communicator is built (bounded by the epoch deadline).
        # Lazy connection (TORCH_GLOO_LAZY_INIT) was rejected: a send to a peer that died first blocks ~50 s.
        client = EtcdClient(c.etcd_config(), monotonic=True)  # a store that went back: JobStateLost
        self._closers.append(client.close)
        record = MemberRecord(c.role, c.member_id, c.incarnation, c.host, c.domain, c.device,
                              layout_rank=c.layout_rank, layout=self._side.described,
                              deltas=c.transfer.delta_base_bytes > 0, shard=self._side.shard)
        membership = Membership(client, c.job, record, c.membership_config())
        self._closers.append(membership.close)
        layout_cache = LayoutCache(LayoutStore(client, c.job), self._known_layouts)
        if torch.device(c.device).type == "cuda":
            # Before joining: a newcomer's first refit must not compile the pack kernels.
            t0 = time.perf_counter()
            warm_up(c.device, deltas=c.transfer.delta_base_bytes > 0)
            self.log.info("refit.kernels.warmed", seconds=time.perf_counter() - t0)
        membership.start()
        # Peers that see the record before this lands find the layout unavailable and wait.
        layout_cache.publish(membership, self._side.layout, self._side.formats)
        versions = VersionStore(client, c.job)
        # The agent reads version state and its epoch's keys when they change, not on a
        # timer: an idle member costs etcd its keepalive and a few watch streams. The version
        # state is the tracker's, kept from its watch (each key parsed once, when it lands).
        changes = ChangeSignal(client)
        self._closers.append(changes.close)
        tracker = VersionTracker(client, c.job, progress_interval_s=changes.progress_interval_s,
                                                stall_timeout_s=changes.stall_timeout_s)
        tracker.on_change(lambda _reset, _events: changes.bump())
        tracker.on_change(membership.hold_newcomers_for(tracker.state))  # a recovery's commit waits for no grow
        tracker.start()
        self._closers.append(tracker.stop)
        changes.watch("layouts", versions.keys.layouts_prefix)  # a peer's layout unblocks a plan
        membership.on_view(lambda _old, _new: changes.bump())
        membership.on_lost(lambda _reason: changes.bump())  # the agent rejoins at once
        manager = communicator_manager(client, c, membership)
        # Closed after membership's leave (goodbye, lease revoked): peers see a clean leave
        # however long NCCL's aborts then take, or if they crash the process.
        self._closers.insert(self._closers.index(membership.close), manager.close)
        if c.transfer.bind_interface is not None and c.backend != "gloo":
            os.environ.setdefault("NCCL_SOCKET_IFNAME", c.transfer.bind_interface)  # NCCL reads it at init
        return Services(c, client, membership, versions, AttemptLedger(versions), tracker, changes,
                        layout_cache, manager, self.log, self._hooks, self._stop, self.stats)

    def _come_back(self, reason: str) -> Services:
        """The agent's way back after this member's lease was lost (``runtime.rejoin``)."""
        old = self._running.services
        services = self._detachment.come_back(self._side, self._published, reason)
        # The old incarnation's are closed already: its closers give way (the list stays bounded).
        gone = (old.manager.close, old.membership.close)
        self._closers = [c for c in self._closers if c not in gone] + [services.manager.close,
                                                                          services.membership.close]
        self.config = services.config
        self._running = replace(self._running, services=services)
        self._running.participant.follow(services.membership)
        return services

    @property
    def detached(self) -> str | None:
        """Why this member is out of the job (its lease was lost and it registers again, or
        etcd answered no keepalive for longer than the TTL), or None. ``weights()`` says it too."""
        return self._detachment.why()

    @property
    def _services(self) -> Services:
        if self._running is None:
            raise RefitError(f"{self.config.member_id}: the context is not started (use `with ElasticRefit(...)`)")
        return self._running.services

    @property
    def membership(self) -> Membership:
        """This member's registration and view of the job."""
        return self._services.membership

    @property
    def tracker(self) -> VersionTracker:
        """The job's version state, as this member watches it."""
        return self._services.tracker

    @property
    def layout_cache(self) -> LayoutCache:
        """The layouts this member knows (its own, its peers' from etcd)."""
        return self._services.layouts

    def close(self) -> None:
        """Leave the job: stop the agent, revoke the lease (peers see a clean leave)."""
        self._stop.set()
        self._outcomes.close()  # waiters raise now (a latched error first)
        running = self._running
        if running is not None:
            running.services.changes.bump()  # an idle agent waits on it: let it see the stop now
            running.driver.join(self.config.timeouts.epoch_deadline_s)
        # Also what a start that failed half-way opened.
        while self._closers:
            with contextlib.suppress(Exception):
                self._closers.pop()()

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
        newer one overtakes is dropped (its handle resolves to the newer commit), unless the
        transfer under way brings it to every engine: then it commits first.

        Raises :class:`RefitFailed` (with the cause) once ``version`` failed
        ``max_attempts`` consecutive attempts for the same cause (e.g. a tensor of the wrong
        shape or a missing buffer on some trainer), and :class:`RefitTimeout` after
        ``timeout_s`` (default ``version_timeout_s``)."""
        me, published = self.config.member_id, self._published
        if published is None:
            raise ValueError(f"publish is for trainers; {me!r} is {self.config.role}")
        if not is_integer(version) or version < 0:
            raise ValueError(f"version must be an integer >= 0, got {version!r}")
        timeout_s = self._timeout(check_timeout("timeout_s", timeout_s))
        tensors = self._checked_publish(tensors_of(tensors), version)
        published.supersede(version)
        copied = not wait and published.budget_bytes > 0
        if copied:
            # The copy is what moves (nobody else can write it): digests are taken from it.
            tensors = self._snapshot_copy(tensors, version, timeout_s)
        # Taken before any byte moves: what the version is, whatever the buffers do later.
        digests = buffer_digests(tensors)
        data_digest = combine_digests(digests)
        repeat = check_publish(version, data_digest, me, self.tracker.state(), published.last)
        if repeat is not None:
            published.drop(version)
            return repeat if wait else PublishHandle(self._outcomes, version, timeout_s, repeat)
        published.remember(version, data_digest)
        self._announce(version, Published(tensors, self._side.layout.fingerprint, digests,
                                          copy_bytes=_nbytes(tensors) if copied else 0), data_digest)
        handle = PublishHandle(self._outcomes, version, timeout_s)
        if wait:
            try:
                return handle.wait()
            finally:
                published.drop(version)
        if not copied:
            # Hold until sent: the caller's tensors are the sources until this trainer's
            # sends of the version are done (or the version is over one way or the other).
            self._outcomes.wait_for(lambda: True if (published.sent(version) or handle.done()) else None,
                                    timeout_s, f"version {version} to be sent")
        return handle

    def _checked_publish(self, tensors: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
        """``tensors`` checked against this trainer's layout. Bad input fails here, in the
        caller, never as attempts retried until they give up; the version is failed for the
        whole job too (every live trainer must source it), so peers waiting for it raise at
        once."""
        try:
            self._check_buffers(self._side.layout, tensors,
                                f"trainer {self.config.member_id!r}, version {version}: published buffer")
        except ValueError as exc:
            # The watched state: it holds every commit this trainer's earlier publishes returned.
            if (version not in self.tracker.state().committed
                    and self._services.versions.refuse(self.membership, version, fault_cause(exc))):
                self.log.error("refit.version.refused", version=version, cause=str(exc))
            raise
        return tensors

    def _announce(self, version: int, entry: Published, data_digest: str) -> None:
        """Hold ``version`` as a source and tell the job (its digests, and its replica
        regions' digests when sources are checked against each other)."""
        layout, published = self._side.layout, self._published
        regions = (region_digests(layout, self.config.layout_rank, entry.tensors,
                                  self._running.planner.replica_regions(layout),
                                  known=dict(entry.digests)) if self.config.plan.check_replicas else {})
        published.add(version, entry)

        def source() -> None:  # as the member in the job: after a lost lease, its new incarnation
            self._outcomes.wait_for(lambda: True if not self._detachment.rejoining and not self.membership.lost.is_set()
                                    else None, self.config.version_timeout_s, "this member to rejoin the job")
            self._services.versions.publish_source(self.membership, version, data_digest, regions, layout.fingerprint)

        try:
            try:
                source()
            except MembershipLost:  # the lease was lost under the write: once more, rejoined
                source()
            self.log.info("refit.version.published", version=version, copied=entry.copy_bytes > 0)
        except BaseException:
            published.drop(version)
            raise

    def _snapshot_copy(self, tensors: Mapping[str, torch.Tensor], version: int,
                       timeout_s: float) -> dict[str, torch.Tensor]:
        """A private copy of ``tensors`` within ``snapshot_bytes``: waits for room while the
        copies of versions not yet over fill the budget (back-pressure). Older versions'
        copies were dropped already (``supersede``); a transfer still reading one keeps it
        alive until it ends, so memory may exceed the budget by that one."""
        nbytes, budget = _nbytes(tensors), self._published.budget_bytes
        if nbytes > budget:
            raise ValueError(f"trainer {self.config.member_id!r}, version {version}: a snapshot needs {nbytes} "
                             f"bytes, more than snapshot_bytes ({budget})")
        self._outcomes.wait_for(lambda: True if self._published.reserve(version, nbytes) else None, timeout_s,
                                f"room for the snapshot of version {version} (snapshot_bytes {budget})")
        return {name: t.detach().clone(memory_format=torch.contiguous_format) for name, t in tensors.items()}

    # ---- layouts ---------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        """This rank's side, as it describes it now."""
        return self._side.layout

    @property
    def formats(self) -> TensorFormats:
        """The destination formats this rank declared (empty: every tensor as it is)."""
        return self._side.formats

    @property
    def parameters(self) -> dict[str, torch.Tensor]:
        """An inference rank's parameters (what ``weights()`` guards); empty on a trainer."""
        return self._serving.parameters if self._serving is not None else {}

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
        timeout_s = check_timeout("timeout_s", timeout_s)
        side = self._side_of(layout, self._side.formats if formats is None else formats)
        me = self.config.member_id
        new_parameters = None
        if self._serving is not None:
            new_parameters = tensors_of(parameters) if parameters is not None else self._serving.parameters
            self._check_buffers(side.buffer_layout, new_parameters, f"inference rank {me!r}: parameter")
        elif parameters is not None:
            raise ValueError(f"trainer {me!r}: parameters are for inference ranks (trainers publish their buffers)")
        wait_s = 4 * self.config.timeouts.collective_timeout_s if timeout_s is None else timeout_s
        if self._running is None:
            raise RefitError(f"{me}: update_layout needs a started context")
        lock = self._running.participant.lock
        if not lock.acquire(timeout=wait_s):
            raise RefitTimeout("the attempt in flight to finish before the layout change", wait_s, member_id=me)
        try:
            self._change_layout(side, new_parameters)
        finally:
            lock.release()

    def _change_layout(self, side: Side, parameters: dict[str, torch.Tensor] | None) -> None:
        """(No attempt in flight.) Publish ``side`` and, on an inference rank, hold
        ``parameters`` (nothing served until a version arrives in the new layout)."""
        me, s = self.config.member_id, self._services
        if self._published is not None and self._published.in_flight():
            raise ValueError(f"trainer {me!r}: version(s) {self._published.in_flight()} are being published; "
                             "change the layout between publishes")
        if side.described == self._side.described and (self._serving is None
                                                         or parameters is self._serving.parameters):
            return
        fingerprint = self.layout_cache.publish(self.membership, side.layout, side.formats)
        if self._serving is not None:
            # The buffers are about to hold the new layout: nothing this rank acked is held.
            s.versions.retract(self.membership, s.versions.snapshot())
            self._serving.replace(parameters)
        self._side = Side(side.layout, side.formats, side.buffer_layout, fingerprint, side.shard)
        self.membership.update_record(layout=fingerprint, shard=side.shard)
        self.log.info("refit.layout.changed", layout=fingerprint, num_pieces=side.layout.num_pieces,
                      num_buffers=len(side.layout.buffers(self.config.layout_rank)))

    # ---- inference API -----------------------------------------------------------------
    @contextlib.contextmanager
    def weights(self, timeout_s: float | None = None) -> Iterator[ServedVersion]:
        """Hold the parameters still while reading them; yields the committed version they
        hold (a ``ServedVersion``: an int whose ``detached`` says why this member was out of
        the job, or None). Blocks while an update is applied (and, in place, until it
        commits), and while this member is detached if ``serve_when_detached`` is ``block``."""
        keep = self.config.versions.serve_when_detached == "keep"
        with self._inference("weights").reading(lambda: self.detached, keep=keep,
                                                timeout_s=self._timeout(timeout_s)) as version:
            yield version

    def wait_for_version(self, version: int | None = None, timeout_s: float | None = None) -> int:
        """Block until this rank serves a committed version >= ``version`` (any, if None).

        Raises :class:`RefitFailed` if ``version`` failed (and no newer version is served
        yet; for ``None``: the job committed nothing and its newest version failed),
        :class:`RefitTimeout` after ``timeout_s`` (default ``version_timeout_s``). A trainer
        serves nothing: there it only raises what ends this member (its agent's error, e.g.
        ``MembershipLost``) or a failed version, at once, else times out."""
        slot = self._serving
        want = -1 if version is None else version

        def serving() -> int | None:
            served = slot.served(want) if slot is not None else None
            if served is None:  # a failed version, or (any version) a job whose versions all failed
                self._outcomes.raise_if_failed(version)
            return served

        what = "any committed version" if version is None else f"version {version} (or newer) to be served"
        return self._outcomes.wait_for(serving, self._timeout(timeout_s), what)

    @property
    def serving_version(self) -> int | None:
        return self._serving.serving if self._serving is not None else None

    # ---- helpers ----------------------------------------------------------------------------
    def _inference(self, what: str) -> ServingSlot:
        if self._serving is None:
            raise ValueError(f"{what} is for inference ranks; {self.config.member_id!r} is {self.config.role}")
        return self._serving

    def _timeout(self, timeout_s: float | None) -> float:
        return self.config.versions.version_timeout_s if timeout_s is None else timeout_s

    def _side_of(self, layout: Layout, formats: TensorFormats | None) -> Side:
        c = self.config
        return side_of(layout, formats, role=c.role, member_id=c.member_id, layout_rank=c.layout_rank)

    def _check_buffers(self, layout: Layout, tensors: Mapping[str, torch.Tensor], what: str) -> None:
        check_buffers(layout, tensors, what, layout_rank=self.config.layout_rank, device=self.config.device)


@dataclass(frozen=True)
class _Running:
    """The parts of a started context (each owns its state and its lock)."""

    services: Services
    planner: AttemptPlanner
    participant: Participant
    driver: Driver


def _nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
