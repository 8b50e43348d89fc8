"""Connecting ahead: the pairs a plan uses, connected before the first refit needs them.

NCCL connects a pair of ranks lazily, at their first send/receive, and a collective's ring
at its first use (``NCCL_RUNTIME_CONNECT``, on by default). Every reconfiguration (build,
shrink, grow, rebuild) brings a communicator without connections, so the first refit after
it would pay the connection setup of every pair of its plan inside the refit. The runtime
calls :func:`connect_ahead` on entering an epoch instead, while the trainers are still in
their step: a message along every direction the plan sends (one byte on a CPU, a few MiB
on a GPU: ``CONNECT_BYTES_GPU``), then the plan's vote.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from elastic_refit.plan import Plan
from elastic_refit.transport.protocol import P2POp, Transport

__all__ = ["CONNECT_TAG", "PlanPeers", "connect_ahead", "connect_bytes", "plan_peers"]

CONNECT_TAG = 0x7E58  # distinct from bucket tags and the vote's
# What a pair sends ahead on a GPU: one byte travels inline on NCCL's control path (the LL
# protocol; over sockets, inline in the control message), so a refit's first bucket would
# still start the bulk path of every pair (the SIMPLE protocol's buffers, a socket
# transport's helper threads and data sockets). A few MiB go through all of it; gloo has
# no such path (one byte).
CONNECT_BYTES_GPU = 4 << 20


def connect_bytes(device: torch.device) -> int:
    """What each direction sends ahead on ``device``: one byte on a CPU; on a GPU
    ``ELASTIC_REFIT_CONNECT_AHEAD_MIB`` MiB where set (1 to 1024; more warms a socket
    transport's connections further), else :data:`CONNECT_BYTES_GPU`."""
    if device.type == "cpu":
        return 1
    value = os.environ.get("ELASTIC_REFIT_CONNECT_AHEAD_MIB")
    if value is None:
        return CONNECT_BYTES_GPU
    try:
        mib = int(value)
    except ValueError:
        mib = 0
    if not 1 <= mib <= 1024:
        raise ValueError(f"ELASTIC_REFIT_CONNECT_AHEAD_MIB must be an integer from 1 to 1024, got {value!r}")
    return mib << 20


@dataclass(frozen=True, slots=True)
class PlanPeers:
    """The ranks one rank sends to and receives from in a plan (sorted, itself excluded),
    and every rank of the plan (its vote's participants)."""

    send_to: tuple[int, ...]
    recv_from: tuple[int, ...]
    participants: tuple[int, ...]


def plan_peers(plan: Plan, rank: int) -> PlanPeers:
    """Which directions ``rank`` uses in ``plan`` (pure). Both ends of a pair derive the
    same direction from the same plan, so the connect batches match exactly."""
    t = plan.transfers
    remote = t.src_rank != t.dst_rank
    send_to = np.unique(t.dst_rank[remote & (t.src_rank == rank)])
    recv_from = np.unique(t.src_rank[remote & (t.dst_rank == rank)])
    participants = sorted(set(plan.source.ranks) | set(plan.destination.ranks))
    return PlanPeers(tuple(int(r) for r in send_to), tuple(int(r) for r in recv_from),
                     tuple(int(r) for r in participants))


def connect_ahead(transport: Transport, peers: PlanPeers) -> int:
    """Send a message (:func:`connect_bytes`) to every rank
    of ``peers.send_to`` and receive one from every rank of ``peers.recv_from`` in one
    batch (one NCCL group: no order between pairs to deadlock on), then vote with
    ``peers.participants`` as the refit's own vote does. Every rank of the plan must call
    this with its own peers of the same plan, before any other operation on the transport.
    Returns the number of directions connected; raises ``TransportAborted`` like any
    transfer."""
    if transport.rank not in peers.participants:
        return 0
    nbytes = connect_bytes(transport.device)
    message = torch.zeros(nbytes, dtype=torch.uint8, device=transport.device)
    ops = [P2POp("send", message, peer, CONNECT_TAG) for peer in peers.send_to]
    ops += [P2POp("recv", torch.empty_like(message), peer, CONNECT_TAG) for peer in peers.recv_from]
    if ops:
        for op, work in zip(ops, transport.post(ops), strict=True):
            transport.wait(work, op.peer, "connecting ahead")
    transport.vote(True, peers.participants)
    return len(ops)
