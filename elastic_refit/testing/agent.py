"""A member process: join, follow epochs, keep a communicator per epoch.

``python -m elastic_refit.testing.agent --endpoints 127.0.0.1:2379 --job j --role trainer
--member-id t0`` registers one rank, then for every new epoch reconfigures its
communicator (gloo by default) and verifies it with an all-reduce. Events go to stdout as
JSON lines. Used by the integration tests, the membership benchmark and the demo.

Signals: SIGTERM/SIGINT leave cleanly (lease revoked). SIGUSR1 runs a *fencing probe*:
one member write and one epoch write with this process's last leader token, each logged
as ``agent.probe`` with ``succeeded`` -- after a freeze longer than the TTL both must be
rejected by etcd.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import torch

from elastic_refit.log import configure_logging, get_logger
from elastic_refit.membership.client import EtcdClient
from elastic_refit.membership.comm import CommunicatorManager
from elastic_refit.membership.config import MembershipConfig
from elastic_refit.membership.errors import (
    CommunicatorError,
    EpochTimeout,
    MembershipError,
    MembershipLost,
)
from elastic_refit.membership.leader import publish_epoch
from elastic_refit.membership.service import Membership
from elastic_refit.membership.view import MemberRecord, MembershipView
from elastic_refit.transport.protocol import P2POp, Transport


class AgentProcess:
    """One agent process (``python -m elastic_refit.testing.agent``) with its JSON events
    collected from stdout by a reader thread; stopped by pid only."""

    def __init__(self, endpoints: Sequence[str], job: str, member_id: str, *, role: str = "trainer",
                 ttl: int = 2, comm: str = "none", candidate: bool = True, start: bool = True) -> None:
        self.member_id = member_id
        self.args = [sys.executable, "-m", "elastic_refit.testing.agent", "--endpoints", ",".join(endpoints),
                     "--job", job, "--role", role, "--member-id", member_id, "--ttl", str(ttl), "--comm", comm]
        if not candidate:
            self.args.append("--no-candidate")
        self.events: list[dict] = []
        self.cond = threading.Condition()
        self.proc: subprocess.Popen | None = None
        self.pids: list[int] = []  # every process this object started
        if start:
            self.start()

    def start(self) -> None:
        """Start (again: a new incarnation). The package is installed, so the environment
        (PYTHONPATH included) passes through unchanged."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.pids.append(self.proc.pid)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            try:
                event = json.loads(line)
            except ValueError:
                event = {"event": "raw", "line": line.decode(errors="replace").rstrip()}
            event["_t"] = time.time()
            event["_pid"] = proc.pid
            with self.cond:
                self.events.append(event)
                self.cond.notify_all()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def wait_event(self, predicate: Callable[[dict], bool], timeout_s: float = 15.0, since: float = 0.0) -> dict:
        """The first event at or after ``since`` (unix time) that ``predicate`` accepts;
        ``TimeoutError`` with the last events after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                for e in self.events:
                    if e["_t"] >= since and predicate(e):
                        return e
                left = deadline - time.monotonic()
                if left <= 0:
                    tail = "\n".join(json.dumps(e)[:300] for e in self.events[-15:])
                    raise TimeoutError(f"agent {self.member_id}: event not seen in {timeout_s}s; "
                                       f"last events:\n{tail}")
                self.cond.wait(left)

    def find(self, name: str, **fields) -> list[dict]:
        """Every event named ``name`` whose ``fields`` match."""
        with self.cond:
            return [e for e in self.events if e.get("event") == name
                    and all(e.get(k) == v for k, v in fields.items())]

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM (a clean leave) and wait, SIGKILL if it does not exit; the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
                os.kill(self.proc.pid, signal.SIGTERM)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def verify_transport(transport: Transport) -> bool:
    """A fresh communicator works end to end: every rank sends its rank around a ring and
    checks what its predecessor sent, then all vote. False (or ``TransportAborted``) if not.

    The send and the receive are posted as one batch: on a non-blocking NCCL communicator a
    group does not settle until each peer it names has posted the matching half of the pair
    (NCCL connects a pair lazily, on its first group, from both sides). Posted one after the
    other, every rank of the ring waited on its successor's send group and none ever posted
    its receive ("posting a group: not done within 3.0 s" on rank 0 of three nccl4py ranks)."""
    rank, size = transport.rank, transport.world_size
    ok = True
    if size > 1:
        mine = torch.tensor([rank], dtype=torch.int64, device=transport.device)
        theirs = torch.full((1,), -1, dtype=torch.int64, device=transport.device)
        sent, got = transport.post((P2POp("send", mine, (rank + 1) % size), P2POp("recv", theirs, (rank - 1) % size)))
        transport.wait(got, (rank - 1) % size, "ring check receive")
        transport.wait(sent, (rank + 1) % size, "ring check send")
        ok = int(theirs.item()) == (rank - 1) % size
    return transport.vote(ok)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="elastic_refit.testing.agent")
    p.add_argument("--endpoints", required=True, help="comma-separated host:port list")
    p.add_argument("--job", required=True)
    p.add_argument("--role", default="trainer", choices=("trainer", "inference"))
    p.add_argument("--member-id", required=True)
    p.add_argument("--domain", default="d0")
    p.add_argument("--ttl", type=int, default=2)
    p.add_argument("--comm", default="gloo", choices=("none", "gloo"))
    p.add_argument("--no-candidate", action="store_true", help="never campaign for leader")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    configure_logging(json=True, stream=sys.stdout)
    incarnation = uuid.uuid4().hex[:12]
    record = MemberRecord(role=args.role, member_id=args.member_id, incarnation=incarnation,
                          host=socket.gethostname(), domain=args.domain, device="cpu",
                          address=f"pid:{os.getpid()}")
    config = MembershipConfig(ttl_s=args.ttl, candidate=not args.no_candidate)
    log = get_logger(job=args.job, role=args.role, member_id=args.member_id,
                     incarnation=incarnation, pid=os.getpid())
    stop = threading.Event()
    probe = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGUSR1, lambda *_: probe.set())
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # stacks on demand, for debugging

    client = EtcdClient(args.endpoints.split(","))
    membership = Membership(client, args.job, record, config).start()
    manager = (CommunicatorManager(client, args.job, args.member_id, backend="gloo",
                                   config=config) if args.comm == "gloo" else None)
    log.info("agent.started")
    current: MembershipView | None = None
    try:
        while not stop.is_set():
            if probe.is_set():
                probe.clear()
                run_fencing_probe(membership, current, log)
            try:
                membership.wait_for_view(after_epoch=current.epoch if current else 0,
                                         timeout_s=0.1)
            except EpochTimeout:
                continue
            except MembershipLost:
                time.sleep(0.1)  # stay up (and probe-able) until told to stop
                continue
            new = membership.view
            if new is None or (current is not None and new.epoch <= current.epoch):
                continue
            if manager is not None and args.member_id in new:
                try:
                    res = manager.reconfigure(current, new)
                    ok = verify_transport(res.transport)
                    log.info("comm.verified", epoch=new.epoch, total=float(res.transport.world_size),
                             expected=float(new.num_ranks), ok=ok)
                except (CommunicatorError, RuntimeError) as exc:
                    # A newer epoch usually explains it (a peer died mid-rendezvous).
                    log.warning("comm.reconfigure.failed", epoch=new.epoch, error=str(exc)[:300])
                    manager.close()
                    current = new
                    continue
                except MembershipLost as exc:
                    log.warning("agent.not_in_epoch", epoch=new.epoch, error=str(exc))
            current = new
    finally:
        if manager is not None:
            manager.close()
        membership.close()
        client.close()
        log.info("agent.stopped", lost=membership.lost.is_set())
    return 0


def run_fencing_probe(membership: Membership, current: MembershipView | None, log) -> None:
    """Attempt the two writes a stale member/leader could make; log whether etcd took them."""
    try:
        membership.fenced_put(membership.keys.prefix + f"probe/{membership.record.member_id}",
                              b"stale-write")
        log.info("agent.probe", write="member", succeeded=True)
    except MembershipLost as exc:
        log.info("agent.probe", write="member", succeeded=False, error=str(exc))
    except MembershipError as exc:
        log.info("agent.probe", write="member", succeeded=False, error=str(exc))
    token = membership.last_leader_token
    if token is None:
        log.info("agent.probe", write="epoch", succeeded=None, reason="never led")
        return
    base = current or membership.view
    fake = MembershipView(epoch=(base.epoch + 1) if base else 1,
                          members=(membership.record,), based_on_revision=0)
    epoch_kv = membership.client.get(membership.keys.epoch)
    # Use the epoch's *current* mod_revision so only the leader token can fail the write.
    res = publish_epoch(membership.client, membership.keys, token,
                        epoch_kv.mod_revision if epoch_kv else 0, fake)
    log.info("agent.probe", write="epoch", succeeded=res.succeeded, token=token)


if __name__ == "__main__":
    sys.exit(main())
