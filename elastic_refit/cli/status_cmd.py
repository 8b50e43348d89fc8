"""`elastic-refit status --etcd HOST:PORT --job NAME`: a job's members, leader, epoch and versions.

Reads etcd through ``membership`` only (one range read per key family); never writes.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from elastic_refit.cli._etcd import add_etcd_arguments, etcd_config
from elastic_refit.cli._output import print_json, render_table

if TYPE_CHECKING:
    from elastic_refit.membership.client import EtcdConfig

__all__ = ["job_status", "register", "render_status", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="show a job's members, leader, epoch and committed versions",
                                   description="Read a running job's state from etcd (read-only).")
    add_etcd_arguments(parser)
    parser.add_argument("--job", required=True, help="job name")
    parser.add_argument("--last", type=int, default=5, help="committed versions to list (default 5)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(handler=run)


def job_status(endpoints: list[str] | EtcdConfig, job: str, last: int = 5) -> dict[str, Any]:
    """The job's state as plain data: members by role, leader, epoch, versions, acks
    (``endpoints``: etcd's, or an ``EtcdConfig`` with TLS and credentials)."""
    from elastic_refit.membership import EtcdClient, JobKeys, MemberRecord, MembershipView
    from elastic_refit.membership.versions import VersionStore

    if last < 1:
        raise ValueError(f"--last must be >= 1, got {last}")
    keys = JobKeys(job)
    with EtcdClient(endpoints) as client:
        if client.count_prefix(keys.prefix) == 0:
            where = ",".join(endpoints.endpoints if hasattr(endpoints, "endpoints") else endpoints)
            raise ValueError(f"no job {job!r} in the etcd at {where} (nothing under {keys.prefix}): "
                             f"check --job and --etcd")
        members_kv = client.get_prefix(keys.members_prefix).kvs
        leader_kv = client.get(keys.leader)
        epoch_kv = client.get(keys.epoch)
        state = VersionStore(client, job).snapshot()
    view = MembershipView.decode(epoch_kv.value) if epoch_kv is not None else None
    members: dict[str, list[dict[str, Any]]] = {"trainer": [], "inference": []}
    for kv in members_kv:
        parsed = keys.parse_member_key(kv.key)
        if parsed is None:
            continue
        record = MemberRecord.decode(kv.value)
        in_epoch = view is not None and record.member_id in view and \
            view.member(record.member_id).incarnation == record.incarnation
        members[record.role].append({
            "member_id": record.member_id, "incarnation": record.incarnation, "host": record.host,
            "domain": record.domain, "device": record.device, "layout_rank": record.layout_rank,
            "layout": record.layout, "state": record.state, "in_epoch": in_epoch,
            "rank": view.rank_of(record.member_id) if in_epoch else None})
    for group in members.values():
        group.sort(key=lambda m: (m["layout_rank"], m["member_id"]))
    leader = None
    if leader_kv is not None:
        data = json.loads(leader_kv.value)
        leader = {"member_id": data.get("member_id"), "incarnation": data.get("incarnation"),
                  "token": leader_kv.create_revision}
    latest = state.latest_committed
    committed = [{"version": c.version, "epoch": c.epoch, "digest": c.digest}
                 for _, c in sorted(state.committed.items())[-last:]][::-1]
    acks = [{"member_id": m, "incarnation": a.incarnation, "epoch": a.epoch, "digest": a.digest}
            for m, a in sorted(state.acks.get(latest, {}).items())] if latest is not None else []
    pending = sorted(v for v in state.sources if latest is None or v > latest)
    return {
        "job": job,
        "revision": state.revision,
        "epoch": view.epoch if view else None,
        "epoch_members": list(view.member_ids) if view else [],
        "leader": leader,
        "members": members,
        "latest_committed": latest,
        "committed": committed,
        "latest_acks": acks,
        "pending_versions": pending,
    }


def run(args: argparse.Namespace) -> int:
    """Print the status table (or JSON)."""
    data = job_status(etcd_config(args), args.job, args.last)
    if args.json:
        print_json(data)
        return 0
    print(render_status(data))
    return 0


def render_status(data: dict[str, Any]) -> str:
    """The human-readable status: header, members, versions, acks."""
    leader = data["leader"]
    out = [f"job {data['job']}  epoch {data['epoch'] if data['epoch'] is not None else '-'}  "
           f"leader {leader['member_id'] + ' (token ' + str(leader['token']) + ')' if leader else '-'}  "
           f"latest committed {data['latest_committed'] if data['latest_committed'] is not None else '-'}"]
    for role in ("trainer", "inference"):
        rows = [[m["member_id"], m["incarnation"], m["host"], m["domain"], m["layout_rank"],
                 m["layout"][:12] or "-", m["state"], "-" if m["rank"] is None else m["rank"]]
                for m in data["members"][role]]
        out.append("")
        out.append(f"{role} ranks ({len(rows)})")
        out.append(render_table(["member", "incarnation", "host", "domain", "layout rank", "layout", "state",
                                 "epoch rank"], rows) if rows else "  none")
    out.append("")
    out.append(render_table(["version", "epoch", "digest"],
                            [[f"v{c['version']}", c["epoch"], c["digest"]] for c in data["committed"]])
               if data["committed"] else "no committed version")
    if data["latest_acks"]:
        out.append("")
        out.append(f"acks of v{data['latest_committed']}")
        out.append(render_table(["member", "incarnation", "epoch", "digest"],
                                [[a["member_id"], a["incarnation"], a["epoch"], a["digest"]]
                                 for a in data["latest_acks"]]))
    if data["pending_versions"]:
        out.append(f"\npublished, not committed yet: {', '.join(f'v{v}' for v in data['pending_versions'])}")
    return "\n".join(out)
