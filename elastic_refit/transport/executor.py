"""The executor: move one rank's share of a plan over a ``Transport``.

Per step (a round of a phase) a rank sends at most one message and receives at most one.
The plan's ``concurrent_rounds`` consecutive rounds of a phase form a window, and a window's
messages are in flight together: for each bucket index, one batch posts that bucket of every
message of the window (one NCCL group). A bucket is packed with one kernel launch into a
staging buffer, or sent straight from the parameter when it is one contiguous box; each
message that packs has two staging buffers, which overlap packing, transfer and unpacking.
Staging is at most four buckets per round of the window (plus digest trailers), and the
executor refuses a plan whose windows need more than ``staging_bytes``.

Relayed plans add forwards: a rank that receives a network message forwards bucket ``i - 1``
of it over the domain, straight from where it arrived (one operation per run of bytes), in
the batch that carries bucket ``i``, so NVLink works while the NIC does; a needer receives
each run into its parameter when it is one contiguous box there, else into one staging
buffer that is unpacked. Staging stays bounded: two buffers per packing message and one
per forward that needs staging, per window. With verification on, a forward carries the
digests its boxes arrived with at the relay (the relay checked them; nothing is recomputed),
and the needer checks every box where it landed before unpacking staging.

Plans in a quantized destination format (``Plan.quantization``): the caller passes its BF16
source buffers, and before its first message a sender quantizes every source piece it sends
from into FP8 and scale staging (:class:`~elastic_refit.transport.source_quant.SourceQuantizer`);
the plan's rows then move those bytes like any others.

The parts: :mod:`~elastic_refit.transport.bucket_io` (a bucket bound to this rank's tensors:
pack, unpack, direct views, digests), :mod:`~elastic_refit.transport.window` (the windows,
and the records of one window's messages, forwards and posted operations),
:mod:`~elastic_refit.transport.options` (``ExecutorOptions``).

Any failure aborts the transport so peers fail fast, and every rank ends with a vote, so a
rank whose own transfers all succeeded still learns that the refit did not.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping

import structlog
import torch

from elastic_refit.errors import TransferRefused, brief
from elastic_refit.log import ensure_configured
from elastic_refit.plan import Plan, SourceSide
from elastic_refit.transport import delta_warm
from elastic_refit.transport.bucket_io import BucketIO, ForwardIn, aligned
from elastic_refit.transport.buffers import fits, resolve_buffers
from elastic_refit.transport.delta import DeltaCoder, DeltaInputs, DeltaRound
from elastic_refit.transport.options import ExecutorOptions, MiB
from elastic_refit.transport.protocol import P2POp, Transport
from elastic_refit.transport.report import Phases, TransferReport
from elastic_refit.transport.schedule import Step, build_rank_schedule
from elastic_refit.transport.source_quant import SourceQuantizer
from elastic_refit.transport.window import Posted, Window, WindowForward, WindowMessage, cut_windows

__all__ = ["FORWARD_TAG", "DeltaInputs", "Executor", "ExecutorOptions", "MiB", "TransferReport"]

log = structlog.get_logger("elastic_refit.transport")  # lazy: follows whatever configuration is current

# Forwards between a pair are told apart from its network buckets by tag (gloo matches on it).
FORWARD_TAG = 1 << 20


class Executor:
    """Runs rank ``rank``'s share of ``plan`` over ``transport``; build once per epoch."""

    def __init__(self, plan: Plan, transport: Transport, options: ExecutorOptions | None = None) -> None:
        ensure_configured()  # structlog's default would print to stdout
        self.plan = plan
        self.transport = transport
        self.options = options or ExecutorOptions()
        self.rank = transport.rank
        self.schedule = build_rank_schedule(plan, self.rank)
        self.device = transport.device
        # Intra-domain messages with peers whose memory the transport maps (CUDA IPC on one
        # host) are read directly, outside the windows; the report still counts every byte.
        self._full_schedule = self.schedule
        self._direct = None
        # A plan that casts packs on its senders (a direct read would copy the source's dtype).
        if getattr(transport, "direct_peers", None) and getattr(plan, "cast", None) is None:
            from elastic_refit.transport.direct import DirectReads

            self._direct = DirectReads(plan, self.schedule, transport, self.options)
            self.schedule = self._direct.network_schedule
        self._io: dict[int, BucketIO] = {}
        self._forward_in: dict[int, ForwardIn] = {}
        # A message that may carry deltas packs every bucket (a delta travels in staging).
        packing = dataclasses.replace(self.options, zero_copy=False)
        for step in self.schedule.steps:
            for msg in (step.send, step.recv):
                if msg is not None:
                    opts = packing if self.options.delta and DeltaCoder.may_carry(msg) else self.options
                    for bucket in msg.buckets:
                        self._io[id(bucket)] = BucketIO(bucket, self.schedule, opts, self.device)
            for forward in step.forward_recvs:
                for part in forward.parts:
                    self._forward_in[id(part)] = ForwardIn(part, self.schedule, self.options, self.device)
        self.windows = cut_windows(self.schedule.steps, plan.options.concurrent_rounds)
        staged = [io.wire_bytes for io in self._io.values() if io.direct is None]
        staged += [f.part.nbytes for f in self._forward_in.values() if f.io is not None]
        self.max_wire_bytes = max(staged, default=0)
        # Each message that packs holds two staging buffers for as long as its window runs,
        # and each forward received partly into staging one (a relay forwards straight from
        # where its bytes arrived): message or forward id -> its first buffer, per window
        # (sends first), fixed for the epoch.
        self._slots: list[dict[int, int]] = []
        num_slots = [0]
        for window in self.windows:
            messages = [s.send for s in window if s.send] + [s.recv for s in window if s.recv]
            packing = [m for m in messages if any(self._io[id(b)].direct is None for b in m.buckets)]
            slots = {id(m): 2 * k for k, m in enumerate(packing)}
            gathering = [f for s in window for f in s.forward_recvs
                         if any(self._forward_in[id(p)].io is not None for p in f.parts)]
            slots.update({id(f): 2 * len(packing) + k for k, f in enumerate(gathering)})
            self._slots.append(slots)
            num_slots.append(2 * len(packing) + len(gathering))
        self.num_staging_slots = max(num_slots)
        # Cast plans go in full (a delta's units are the buffers' elements); quantized ones
        # compare what their senders quantize, kept per version (``_kept``).
        full = getattr(plan, "cast", None) is not None
        self._delta = (DeltaCoder(self.schedule, self._io, quantized=full,
                                  verify=self.options.verify, device=self.device, domains=plan.topology.domains,
                                  destinations=frozenset(plan.destination.ranks))
                       if self.options.delta else None)
        self._round: DeltaRound | None = None  # the refit's deltas
        self._kept: dict[int, torch.Tensor] = {}  # a quantized plan's staging, by version sent
        needed = self.num_staging_slots * aligned(self.max_wire_bytes)
        self.staging_needed = needed
        if needed > self.options.staging_bytes:
            rounds = plan.options.concurrent_rounds
            raise ValueError(
                f"rank {self.rank}: buckets of up to {self.max_wire_bytes} bytes in windows of {rounds} "
                f"round(s) need {needed} bytes of staging ({self.num_staging_slots} buffers), above the "
                f"budget of {self.options.staging_bytes}; plan with PlanOptions(bucket_bytes <= "
                # forwards of relayed plans may need more buffers than four per round
                f"{self.options.staging_bytes // max(4 * rounds, self.num_staging_slots)}) or fewer "
                f"concurrent_rounds, or give more staging"
            )
        self._staging: list[torch.Tensor] = []
        self._quantizer = (SourceQuantizer(plan, self.rank, self.device, self.options.pack_backend)
                           if plan.quantization is not None else None)
        # Only the ranks with pieces in the plan take part (a catch-up refit may leave the
        # trainers out of an epoch's communicator).
        self.participants = tuple(sorted(set(plan.source.ranks) | set(plan.destination.ranks)))

    # ---- public ----------------------------------------------------------------------
    @property
    def staging_allocated(self) -> int:
        return sum(t.numel() for t in self._staging)

    def run(self, source: Mapping[str, torch.Tensor] | None = None,
            destination: Mapping[str, torch.Tensor] | None = None, *,
            before_vote: Callable[[], None] | None = None, delta: DeltaInputs | None = None) -> TransferReport:
        """Move this rank's bytes: ``source`` and ``destination`` map buffer names to tensors.

        ``delta`` (with ``ExecutorOptions.delta``): buckets to ``delta.receivers`` may go as
        their change against ``delta.base`` (see :mod:`elastic_refit.transport.delta`).

        ``before_vote`` runs once this rank's sends and receives are done, before its
        closing vote; if it raises, this rank votes no (every participant then fails the
        refit, the communicator stays usable) and its exception propagates. A check there
        (e.g. that the sources still hold what was published) is known to every participant
        once the vote passes, without another round trip, and runs while peers finish.

        Raises ``TransportAborted`` when this or any other rank fails, ``ValueError`` for
        missing or mismatched buffers (after aborting the transport so peers do not hang).
        """
        start = time.perf_counter()
        phases = Phases(start)  # where a refit's seconds go, in its done event
        try:
            if self._quantizer is not None:
                source = self._quantizer.run(source or {}, self.transport)
                if self._delta is not None and delta is not None:
                    delta = self._quantized_base(delta)
            tensors = resolve_buffers(self.schedule.buffers, source or {}, destination or {}, rank=self.rank,
                                      device=self.device)
            self._ensure_staging()
            phases.mark("prepare")
            counts = {"num_buckets": 0, "num_zero_copy_buckets": 0, "num_verified_boxes": 0}
            if self._delta is not None and delta is not None:
                started = time.perf_counter()
                self._round = self._delta.prepare(delta, tensors, self.transport)
                self._round.seconds["code"] += time.perf_counter() - started
            for copy in self.schedule.local_copies:
                self._local_copy(copy, tensors)
            if self._direct is not None:
                self._direct.run(tensors)
                phases.mark("direct")
            for window, slots in zip(self.windows, self._slots, strict=True):
                self._exchange(window, slots, tensors, counts)
            if self._round is not None:
                self._round.flush()
            phases.mark("exchange")
            if self._direct is not None:  # fan-outs read what the network phase delivered
                self._direct.run_fan_out(tensors)
                phases.mark("fan_out")
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                phases.mark("sync")
        except BaseException as exc:
            log.warning("transport.executor.failed", rank=self.rank, error=brief(exc))
            self.transport.abort()
            raise
        finally:
            rnd = self._round if self._round is not None else DeltaRound()
            self._round = None
        refused: BaseException | None = None
        if before_vote is not None:
            try:
                before_vote()
            except Exception as exc:
                refused = exc
        phases.mark("before_vote")
        voted = self.transport.vote(refused is None, self.participants)
        phases.mark("vote")
        if not voted:
            if refused is not None:
                raise refused
            raise TransferRefused(f"rank {self.rank}: another rank voted the refit down at its close",
                                  rank=self.rank, phase="vote")
        return self._report(time.perf_counter() - start, counts, rnd, phases.seconds)

    def warm(self, source: Mapping[str, torch.Tensor] | None = None,
             destination: Mapping[str, torch.Tensor] | None = None) -> int:
        """Get ready for the first :meth:`run` with these buffers without moving a byte:
        allocate staging and bind every packing bucket's kernel program to its buffers and
        staging slot (on a GPU each binding copies descriptors to the device). The runtime
        calls it on entering an epoch, beside connecting ahead, so the epoch's first refit
        does not pay it. Buffers not given are skipped (their buckets bind at the first run);
        a binding for other buffers than the run's is never used. With deltas on, the delta
        codec's kernels load too (:func:`delta_warm.warm_up`, once per process). Returns the
        buckets bound."""
        if self._delta is not None:
            delta_warm.warm_up(self.device)
        given = {(int(SourceSide.SOURCE), n): t for n, t in (source or {}).items()}
        given.update({(int(SourceSide.DESTINATION), n): t for n, t in (destination or {}).items()})
        buffers = self.schedule.buffers
        tensors = {ref: t for ref, t in given.items()  # what run would take (it names the rest)
                   if ref in buffers and fits(t, buffers[ref], self.device)}
        self._ensure_staging()
        bound = 0
        for window, slots in zip(self.windows, self._slots, strict=True):
            for step in window:
                for msg in (step.send, step.recv):  # bucket i packs / unpacks in slot i % 2
                    first = slots.get(id(msg)) if msg is not None else None
                    if first is not None:
                        for i, bucket in enumerate(msg.buckets):
                            io = self._io[id(bucket)]
                            bound += io.direct is None and io.warm(tensors, self._staging[first + i % 2])
                for f in step.forward_recvs:  # what a forward lands in staging unpacks from its slot
                    first = slots.get(id(f))
                    for part in f.parts if first is not None else ():
                        io = self._forward_in[id(part)].io
                        bound += io is not None and io.warm(tensors, self._staging[first])
        return bound

    # ---- internals ---------------------------------------------------------------------
    def _report(self, seconds: float, counts: Mapping[str, int], rnd: DeltaRound,
                phases: Mapping[str, float]) -> TransferReport:
        """What one refit moved on this rank (bytes by kind from the plan, what the round
        counted), logged as ``transport.executor.done``."""
        by_kind = self._full_schedule.bytes_by_kind()
        report = TransferReport(
            rank=self.rank,
            seconds=seconds,
            network_send_bytes=by_kind["network_send"],
            network_recv_bytes=by_kind["network_recv"],
            intra_send_bytes=by_kind["intra_send"],
            intra_recv_bytes=by_kind["intra_recv"],
            local_bytes=by_kind["local"],
            num_buckets=counts["num_buckets"],
            num_zero_copy_buckets=counts["num_zero_copy_buckets"],
            staging_bytes=self.staging_allocated,
            num_verified_boxes=counts["num_verified_boxes"] + rnd.verified_boxes,
            num_delta_buckets=rnd.num_buckets,
            network_saved_bytes=rnd.saved_bytes["network"],
            intra_saved_bytes=rnd.saved_bytes["intra"],
            direct_recv_bytes=self._direct.nbytes if self._direct is not None else 0,
        )
        log.info("transport.executor.done", rank=self.rank, seconds=report.seconds,
                 sent_bytes=self.schedule.send_bytes, recv_bytes=self.schedule.recv_bytes,
                 local_bytes=report.local_bytes, num_buckets=report.num_buckets,
                 num_delta_buckets=report.num_delta_buckets,
                 saved_bytes=report.network_saved_bytes + report.intra_saved_bytes,
                 **{f"delta_{part}_s": round(s, 6) for part, s in rnd.seconds.items() if s},
                 **{f"phase_{part}_s": round(s, 6) for part, s in phases.items()})
        return report

    def _quantized_base(self, delta: DeltaInputs) -> DeltaInputs:
        """A quantized plan's deltas compare FP8 bytes and scales: the base is what this
        sender quantized for ``delta.base_version`` (kept when it sent it; none: full
        bytes), and what it quantized now is kept for the next refit (two copies of the
        staging, the latest versions: a retry of a version still finds its base)."""
        q = self._quantizer
        assert q is not None and q.arena is not None
        kept = self._kept.get(delta.base_version) if delta.base_version is not None else None
        if delta.version is not None:
            self._kept[delta.version] = q.arena.clone()
            for old in sorted(self._kept)[:-2]:
                del self._kept[old]
        base = dict(delta.base)
        for name in q.buffers:
            base.pop(name, None)
        if kept is not None:
            base.update(q.views(kept))
        return dataclasses.replace(delta, base=base)

    def _ensure_staging(self) -> None:
        if not self._staging and self.num_staging_slots:
            # 8-byte aligned so digest trailers can be viewed as int64.
            size = aligned(self.max_wire_bytes)
            self._staging = [torch.empty(size, dtype=torch.uint8, device=self.device)
                             for _ in range(self.num_staging_slots)]

    def _local_copy(self, copy, tensors) -> None:
        src = tensors[copy.src.buffer][tuple(slice(o, o + n) for o, n in zip(copy.src.offsets, copy.src.lengths, strict=True))]
        dst = tensors[copy.dst.buffer][tuple(slice(o, o + n) for o, n in zip(copy.dst.offsets, copy.dst.lengths, strict=True))]
        dst.copy_(src.reshape(dst.shape))

    def _exchange(self, window: tuple[Step, ...], slots: dict[int, int], tensors, counts) -> None:
        """Move every message of one window: bucket ``i`` of all of them in one batch, while
        bucket ``i - 1`` of each is unpacked. ``slots``: each packing message's (and
        gathering forward's) first staging buffer.

        Relayed plans forward bucket ``i - 1`` of a received network message in batch ``i``,
        beside bucket ``i`` of the network message (so NVLink works under the network): the
        relay waits for bucket ``i - 1`` before it posts batch ``i``, and every forward of
        batch ``i`` is done before batch ``i + 1`` reuses its staging. Batch ``i`` waits only
        on batches before it, on every rank, so no rank waits in a cycle."""
        transport = self.transport
        if self._round is not None:  # fan-out messages of this window are sized now
            with self._round.timed("late"):
                self._delta.late(self._round, window, tensors, transport)  # type: ignore[union-attr]
        w = Window.of(window, slots)
        for i in range(w.num_batches):
            prev = (i - 1) % 2
            for m in w.relayed:  # the forwards of bucket i - 1 join this batch: have it first
                if 1 <= i <= len(m.msg.buckets):
                    self._finish_recv(m, prev, tensors, counts)
            # Bucket i of every message goes in one batch: a rank sends to one peer and
            # receives from another, and a backend that connects pairs lazily inside a group
            # (NCCL) would otherwise wait in a cycle of such ranks.
            ops = (self._post_sends(w.sends, i, tensors, counts) + self._post_recvs(w.recvs, i, tensors, counts)
                   + self._post_forward_sends(w.forward_sends, i, counts)
                   + self._post_forward_recvs(w.forward_recvs, i, tensors, counts))
            if ops:
                for op, work in zip(ops, transport.post([op.op for op in ops]), strict=True):
                    op.work = work
            for m in w.recvs:
                if i >= 1 and i - 1 < len(m.msg.buckets) and m.slots[prev] is not None and m.slots[prev].pending:
                    self._finish_recv(m, prev, tensors, counts)
            for f in w.forward_recvs:
                self._finish_forward_recv(f, tensors, counts)
            for f in w.forward_sends:
                for op in f.ops:  # the bytes' staging is reused by batch i + 1
                    op.wait(transport)
                f.ops = []
        for m in w.sends:
            for op in m.slots:
                if op is not None and op.pending:
                    op.wait(transport)

    def _staging_of(self, first_slot: int | None, slot: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of staging buffer ``slot`` (0 or 1) of a packing message."""
        return self._staging[first_slot + slot][:nbytes]  # type: ignore[operator]

    def _post_sends(self, sends: list[WindowMessage], i: int, tensors, counts) -> list[Posted]:
        """Bucket ``i`` of every message this rank sends: packed into its staging slot once
        that slot's previous send is done, or straight from the parameter."""
        ops = []
        slot = i % 2
        for m in sends:
            if i >= len(m.msg.buckets):
                continue
            io = self._io[id(m.msg.buckets[i])]
            if self._round is not None and self._round.skips(io):  # travels with an earlier delta bucket
                continue
            prior = m.slots[slot]
            if prior is not None and prior.pending:  # the staging slot is free once its send is done
                prior.wait(self.transport)
            coded = None if self._round is None else self._delta.payload(self._round, io)  # type: ignore[union-attr]
            if coded is not None:
                payload = coded
            elif io.direct is not None:
                payload = io.direct_view(tensors)
                counts["num_zero_copy_buckets"] += 1
            else:
                payload = self._staging_of(m.first_slot, slot, io.wire_bytes)
                io.pack(tensors, payload, self.options.verify)
            m.slots[slot] = Posted(P2POp("send", payload, m.msg.peer, i), f"send ({m.place})", io)
            ops.append(m.slots[slot])
            counts["num_buckets"] += 1
        return ops

    def _post_recvs(self, recvs: list[WindowMessage], i: int, tensors, counts) -> list[Posted]:
        """Bucket ``i`` of every message this rank receives: into its staging slot, or
        straight into the parameter."""
        ops = []
        slot = i % 2
        for m in recvs:
            if i >= len(m.msg.buckets):
                continue
            io = self._io[id(m.msg.buckets[i])]
            if self._round is not None and self._round.skips(io):  # arrives with an earlier delta bucket
                continue
            size = None if self._round is None else self._round.size(io)
            target = (io.direct_view(tensors) if io.direct is not None
                      else self._staging_of(m.first_slot, slot, io.wire_bytes if size is None else size))
            m.slots[slot] = Posted(P2POp("recv", target, m.msg.peer, i), f"receive ({m.place})", io)
            ops.append(m.slots[slot])
            counts["num_buckets"] += 1
        return ops

    def _post_forward_sends(self, forwards: list[WindowForward], i: int, counts) -> list[Posted]:
        """A relay's forwards of bucket ``i - 1``: each span straight from where it arrived
        (that bucket was received before this batch), then, with verification on, the
        digests its boxes arrived with (checked then)."""
        ops = []
        for f in forwards:
            part = f.parts.get(i - 1)
            if part is None:
                continue
            arrived = f.source.slots[(i - 1) % 2]  # type: ignore[union-attr]
            io, data = arrived.io, arrived.op.tensor  # type: ignore[union-attr]
            coded = None if self._round is None else self._delta.forward(self._round, io, part, data)  # type: ignore[union-attr]
            payloads = coded if coded is not None else [data[offset : offset + nbytes] for offset, nbytes in part.spans]
            if self.options.verify and coded is None:
                trailer = data[io.trailer_offset : io.wire_bytes].view(torch.int64)
                payloads.append(trailer[list(part.digests)].view(torch.uint8))
            f.ops = [Posted(P2POp("send", payload, f.forward.peer, FORWARD_TAG + i - 1), f"send ({f.place})")
                     for payload in payloads]
            ops += f.ops
            counts["num_buckets"] += 1
        return ops

    def _post_forward_recvs(self, forwards: list[WindowForward], i: int, tensors, counts) -> list[Posted]:
        """A needer's receives of bucket ``i - 1``'s forwards: each span straight into the
        parameter when it is one contiguous box there, else at its place in staging; then,
        with verification on, the digests the boxes came with at the relay."""
        ops = []
        for f in forwards:
            part = f.parts.get(i - 1)
            if part is None:
                continue
            arrival = self._forward_in[id(part)]
            coded = None if self._round is None else self._delta.landing(self._round, part)  # type: ignore[union-attr]
            staging = None if arrival.io is None or coded is not None else self._staging_of(f.first_slot, 0, part.nbytes)
            targets = coded or []
            for direct, offset, nbytes in arrival.spans if coded is None else ():
                if direct is not None:
                    targets.append(BucketIO.direct_view_of(tensors, direct))
                    counts["num_zero_copy_buckets"] += 1
                else:
                    targets.append(staging[offset : offset + nbytes])  # type: ignore[index]
            if self.options.verify and coded is None:
                targets.append(arrival.digests.view(torch.uint8))  # type: ignore[union-attr]
            f.ops = [Posted(P2POp("recv", target, f.forward.peer, FORWARD_TAG + i - 1), f"receive ({f.place})")
                     for target in targets]
            ops += f.ops
            f.landing = (arrival, staging)
            counts["num_buckets"] += 1
        return ops

    def _finish_recv(self, m: WindowMessage, slot: int, tensors, counts) -> None:
        """Wait for the bucket in flight in ``slot`` of received message ``m`` and unpack it
        (a bucket received straight into its parameter has nothing to unpack). Its bytes
        stay where they arrived: a relay forwards them from there in the next batch."""
        op = m.slots[slot]
        assert op is not None and op.io is not None
        op.wait(self.transport)
        if op.io.direct is None:
            where = f"rank {self.rank} {m.place}"
            if self._round is not None and self._round.size(op.io) is not None:  # a delta: written in place
                with self._round.timed("accept"):
                    self._delta.accept(self._round, op.io, op.op.tensor, where)  # type: ignore[union-attr]
            else:
                counts["num_verified_boxes"] += op.io.unpack(tensors, op.op.tensor, self.options.verify, where)
        else:
            counts["num_zero_copy_buckets"] += 1

    def _finish_forward_recv(self, f: WindowForward, tensors, counts) -> None:
        """Wait for the part of forward ``f`` in flight (if any), check its digests where
        the boxes landed, then unpack what landed in staging."""
        if not f.ops:
            return
        for op in f.ops:
            op.wait(self.transport)
        arrival, staging = f.landing  # type: ignore[misc]
        where = f"rank {self.rank} {f.place}"
        if self._round is not None and self._round.part(arrival.part) is not None:  # a delta: written in place
            counts["num_verified_boxes"] += self._delta.apply_part(self._round, arrival.part, tensors, where)  # type: ignore[union-attr]
            f.ops = []
            return
        if self.options.verify:  # before anything is unpacked from staging
            counts["num_verified_boxes"] += arrival.check(tensors, staging, where)
        if arrival.io is not None:
            arrival.io.unpack(tensors, staging, False, where)
        f.ops = []
