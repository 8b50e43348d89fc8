"""Execute a whole plan inside one process on one device (all ranks virtual).

A message bucket is packed from the sender's buffers into a staging buffer, copied once
(standing in for the wire), and unpacked into the receiver's buffers: sender and receiver
derive the same byte layout from the plan, so the receiver unpacks the very bytes the
sender packed. Used for single-GPU benchmarks and as a CPU cross-check of the schedules.
In relayed plans, right after a network bucket lands at its receiver, the receiver's
forwards of that bucket gather their runs from the landed bytes and unpack them at the
needers, as the executor does between ranks.

``gather_broadcast_local`` emulates the classic refit on the same device: every tensor is
assembled whole, copied whole to each destination rank holding part of it, and each keeps
its pieces.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from elastic_refit.layout import Layout
from elastic_refit.plan import Plan, SourceSide
from elastic_refit.transport.bucket_io import BucketIO
from elastic_refit.transport.executor import ExecutorOptions
from elastic_refit.transport.schedule import RankSchedule, build_rank_schedule

Buffers = Mapping[int, tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]]  # rank -> (src, dst)


@dataclass(frozen=True, slots=True)
class _Forward:
    """One forward part of a landed bucket: the relay's runs (offset in the bucket, bytes)
    and, at the needer, where the gathered runs unpack."""

    needer: int
    spans: tuple[tuple[int, int], ...]
    unpacker: BucketIO


@dataclass(frozen=True, slots=True)
class _Transfer:
    phase: int
    round: int
    sender: BucketIO
    receiver: BucketIO
    src_rank: int
    dst_rank: int
    direct: tuple | None  # (sender span, receiver span) when both sides are one contiguous span
    forwards: tuple[_Forward, ...] = ()  # what the receiver forwards from this bucket


class LocalTransport:
    """All ranks of ``plan`` on one device; build once, ``run`` per refit."""

    def __init__(self, plan: Plan, device: torch.device | str, pack_backend: str = "auto",
                 copy_wire: bool = True) -> None:
        self.plan = plan
        self.device = torch.device(device)
        self.copy_wire = copy_wire
        options = ExecutorOptions(zero_copy=False, pack_backend=pack_backend, staging_bytes=1 << 62)
        direct = ExecutorOptions(zero_copy=True, pack_backend=pack_backend, staging_bytes=1 << 62)
        ranks = sorted(set(plan.source.ranks) | set(plan.destination.ranks))
        self.schedules: dict[int, RankSchedule] = {r: build_rank_schedule(plan, r) for r in ranks}
        transfers: list[_Transfer] = []
        for rank, schedule in self.schedules.items():
            peer_steps = {}
            for step in schedule.steps:
                if step.send is None:
                    continue
                peer = step.send.peer
                if peer not in peer_steps:
                    peer_steps[peer] = {(s.phase, s.round): s for s in self.schedules[peer].steps}
                peer_step = peer_steps[peer][(step.phase, step.round)]
                recv = peer_step.recv
                assert recv is not None and recv.peer == rank and len(recv.buckets) == len(step.send.buckets)
                forwards = self._forwards(peer, peer_step, options)
                for index, (out_bucket, in_bucket) in enumerate(zip(step.send.buckets, recv.buckets, strict=True)):
                    assert out_bucket.nbytes == in_bucket.nbytes
                    sender = BucketIO(out_bucket, schedule, direct, self.device)
                    receiver = BucketIO(in_bucket, self.schedules[peer], direct, self.device)
                    spans = (sender.direct, receiver.direct) if sender.direct and receiver.direct else None
                    if spans is None:
                        sender = BucketIO(out_bucket, schedule, options, self.device)
                        receiver = BucketIO(in_bucket, self.schedules[peer], options, self.device)
                    transfers.append(_Transfer(int(step.phase), step.round, sender, receiver, rank, peer, spans,
                                               tuple(forwards.get(index, ()))))
        # Deliver phase before fan-out; inside a phase any order is valid.
        transfers.sort(key=lambda t: (t.phase, t.round, t.src_rank, t.dst_rank))
        self.transfers = transfers
        self.max_bucket = max((t.sender.bucket.nbytes for t in transfers), default=0)
        self.bytes_moved = sum(t.sender.bucket.nbytes for t in transfers) + sum(
            c.dst.nbytes for s in self.schedules.values() for c in s.local_copies) + sum(
            f.unpacker.bucket.nbytes for t in transfers for f in t.forwards)
        self.max_bucket = max([self.max_bucket] + [f.unpacker.bucket.nbytes for t in transfers for f in t.forwards])

    def _forwards(self, relay: int, step, options: ExecutorOptions) -> dict[int, list[_Forward]]:
        """The forwards ``relay`` sends in ``step``, by the index of the bucket of its received
        message they come from, each bound to the needer's part of the same step."""
        out: dict[int, list[_Forward]] = {}
        for forward in step.forward_sends:
            needer_step = next(s for s in self.schedules[forward.peer].steps
                               if (s.phase, s.round) == (step.phase, step.round))
            arrival = next(f for f in needer_step.forward_recvs if f.peer == relay)
            parts = {p.bucket: p for p in arrival.parts}
            for part in forward.parts:
                landing = parts[part.bucket]
                assert landing.boxes is not None and landing.nbytes == part.nbytes
                out.setdefault(part.bucket, []).append(_Forward(
                    forward.peer, part.spans,
                    BucketIO(landing.boxes, self.schedules[forward.peer], options, self.device)))
        return out

    def run(self, buffers: Buffers) -> None:
        """One refit: local copies, then every bucket packed, copied and unpacked."""
        staging = [torch.empty(max(self.max_bucket, 1), dtype=torch.uint8, device=self.device) for _ in range(3)]
        tensors = {rank: self._tensors(rank, buffers) for rank in self.schedules}
        for rank, schedule in self.schedules.items():
            for copy in schedule.local_copies:
                src = tensors[rank][copy.src.buffer][_slices(copy.src)]
                dst = tensors[rank][copy.dst.buffer][_slices(copy.dst)]
                dst.copy_(src.reshape(dst.shape))
        for t in self.transfers:
            n = t.sender.bucket.nbytes
            if t.direct is not None:  # contiguous on both sides: the copy is the wire
                src_ref, dst_ref = t.direct
                landed = t.receiver.direct_view_of(tensors[t.dst_rank], dst_ref)
                landed.copy_(t.sender.direct_view_of(tensors[t.src_rank], src_ref))
            else:
                landed = staging[0][:n]
                t.sender.pack(tensors[t.src_rank], landed, False)
                if self.copy_wire:
                    staging[1][:n].copy_(landed)
                    landed = staging[1][:n]
                t.receiver.unpack(tensors[t.dst_rank], landed, False, "local")
            for f in t.forwards:  # the runs, gathered back to back, are what the needer unpacks
                gathered = staging[2][: f.unpacker.bucket.nbytes]
                at = 0
                for offset, nbytes in f.spans:
                    gathered[at : at + nbytes].copy_(landed[offset : offset + nbytes])
                    at += nbytes
                f.unpacker.unpack(tensors[f.needer], gathered, False, "local")

    def _tensors(self, rank: int, buffers: Buffers) -> dict:
        src, dst = buffers.get(rank, ({}, {}))
        out = {}
        for side, name in self.schedules[rank].buffers:
            out[(side, name)] = (src if side == int(SourceSide.SOURCE) else dst)[name]
        return out


def _slices(box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))


class GatherBroadcastLocal:
    """The classic refit on one device: assemble each tensor whole, copy it whole to every
    destination rank holding part of it (a broadcast's bytes), each keeps its pieces."""

    def __init__(self, plan: Plan, device: torch.device | str) -> None:
        self.plan = plan
        self.device = torch.device(device)
        src, dst = plan.source, plan.destination
        self.items = []
        self.bytes_moved = 0
        for t, tensor in enumerate(dst.tensors):
            s = int(plan.source_tensor[t])
            src_rows = np.flatnonzero(src.piece_tensor == s)
            dst_rows = np.flatnonzero(dst.piece_tensor == t)
            receivers = sorted({int(dst.piece_rank[p]) for p in dst_rows})
            self.items.append((tensor, [_piece(src, p) for p in src_rows], [_piece(dst, p) for p in dst_rows], receivers))
            self.bytes_moved += tensor.nbytes * (1 + len(receivers))
        self.max_tensor = max((t.nbytes for t in dst.tensors), default=0)

    def run(self, buffers: Buffers) -> None:
        whole = torch.empty(max(self.max_tensor, 1), dtype=torch.uint8, device=self.device)
        received = torch.empty_like(whole)
        for tensor, src_pieces, dst_pieces, receivers in self.items:
            full = whole[: tensor.nbytes].view(getattr(torch, tensor.dtype)).view(tensor.shape)
            for rank, name, gsl, lsl in src_pieces:  # gather: every source piece into the root's copy
                local = buffers[rank][0][name][lsl]
                full[gsl].copy_(local.reshape(full[gsl].shape))
            for rank in receivers:  # broadcast: the whole tensor to every receiver
                received[: tensor.nbytes].copy_(whole[: tensor.nbytes])
                got = received[: tensor.nbytes].view(getattr(torch, tensor.dtype)).view(tensor.shape)
                for p_rank, name, gsl, lsl in dst_pieces:
                    if p_rank == rank:
                        target = buffers[rank][1][name][lsl]
                        target.copy_(got[gsl].reshape(target.shape))


def _piece(layout: Layout, p: int):
    t = layout.tensors[int(layout.piece_tensor[p])]
    b = int(layout.piece_buffer[p])
    nd_t, nd_b = len(t.shape), int(layout.buffer_ndim[b])
    gsl = tuple(slice(int(o), int(o + n)) for o, n in zip(layout.piece_offsets[p, :nd_t], layout.piece_lengths[p, :nd_t], strict=True))
    lsl = tuple(slice(int(o), int(o + n)) for o, n in zip(layout.piece_local_offsets[p, :nd_b], layout.piece_local_lengths[p, :nd_b], strict=True))
    return int(layout.buffer_rank[b]), layout.buffer_names[int(layout.buffer_name[b])], gsl, lsl
