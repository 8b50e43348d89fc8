"""``verify_transport`` (the ring check of a fresh communicator) against a model of a
non-blocking NCCL communicator's groups, on the CPU.

NCCL connects a pair lazily, from both sides, on the first group that names it: a posted
group does not settle (``NcclTransport.post`` waits for ``ncclSuccess``) until every peer it
names has posted the matching half of the pair. A ring check that posts its send and its
receive one after the other is then a cycle of ranks each waiting on its successor's send
group: on three nccl4py ranks of the H200, rank 0's first ring check timed out ("posting a
group: not done within 3.0 s") after a build that had completed on every rank."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
import torch

from elastic_refit.errors import TransportAborted
from elastic_refit.testing.agent import verify_transport
from elastic_refit.transport.protocol import P2POp


class _Board:
    """What every rank of the model has posted so far, and the bytes in flight."""

    def __init__(self, size: int) -> None:
        self.cond = threading.Condition()
        self.posted: set[tuple[int, str, int]] = set()  # (rank, "send" | "recv", peer)
        self.wire: dict[tuple[int, int], list[torch.Tensor]] = {}  # (src, dst) -> tensors
        self.votes: list[bool] = []
        self.barrier = threading.Barrier(size)


class _GroupedTransport:
    """One rank of the model: ``post`` settles only once every peer of the group posted the
    opposite half of its pair (NCCL's lazy connect); then sends land on the wire."""

    def __init__(self, board: _Board, rank: int, size: int, timeout_s: float) -> None:
        self.board, self.rank, self.world_size, self.timeout_s = board, rank, size, timeout_s
        self.device = torch.device("cpu")

    def post(self, ops: Sequence[P2POp]) -> tuple[tuple[str, P2POp], ...]:
        board = self.board
        with board.cond:
            board.posted |= {(self.rank, op.op, op.peer) for op in ops}
            board.cond.notify_all()
            halves = {(op.peer, "recv" if op.op == "send" else "send", self.rank) for op in ops}
            if not board.cond.wait_for(lambda: halves <= board.posted, self.timeout_s):
                raise TransportAborted(f"rank {self.rank}: posting a group: not done within {self.timeout_s} s")
            for op in ops:
                if op.op == "send":
                    board.wire.setdefault((self.rank, op.peer), []).append(op.tensor.clone())
            board.cond.notify_all()
        return tuple((op.op, op) for op in ops)

    def wait(self, work: tuple[str, P2POp], peer: int, what: str) -> None:
        kind, op = work
        if kind == "send":
            return
        board = self.board
        with board.cond:
            if not board.cond.wait_for(lambda: board.wire.get((peer, self.rank)), self.timeout_s):
                raise TransportAborted(f"rank {self.rank}: {what} with rank {peer} not done")
            op.tensor.copy_(board.wire[(peer, self.rank)].pop(0))

    def vote(self, ok: bool) -> bool:
        with self.board.cond:
            self.board.votes.append(ok)
        self.board.barrier.wait(self.timeout_s)
        return all(self.board.votes)


@pytest.mark.parametrize("size", [2, 3, 5])
def test_the_ring_check_posts_its_pair_as_one_group(size):
    board = _Board(size)
    out: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            out[r] = verify_transport(_GroupedTransport(board, r, size, timeout_s=2.0))
        except Exception as exc:  # reported: the test decides
            out[r] = exc

    t0 = time.monotonic()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out == {r: True for r in range(size)}, out
    assert time.monotonic() - t0 < 2.0, "a rank waited for its group's timeout"
