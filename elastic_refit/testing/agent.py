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
import faulthandler
import os
import signal
import socket
import sys
import threading
import time
import uuid

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
                    check = torch.ones(1)
                    res.communicator.allreduce(check)
                    log.info("comm.verified", epoch=new.epoch, total=float(check.item()),
                             expected=float(new.num_ranks),
                             ok=bool(check.item() == new.num_ranks))
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
