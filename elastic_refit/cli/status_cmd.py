"""`elastic-refit status --etcd HOST:PORT --job NAME`: a job's members, leader, epoch and versions,
its run id, and who is out of the job (a lease gone: detached or dead; come back as a new incarnation).

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

__all__ = ["add_serving", "job_status", "out_of_job", "register", "render_status", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="show a job's members, leader, epoch and committed versions",
                                   description="Read a running job's state from etcd (read-only).")
    add_etcd_arguments(parser)
    parser.add_argument("--job", required=True, help="job name")
    parser.add_argument("--last", type=int, default=5, help="committed versions to list (default 5)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--watch", nargs="?", type=float, const=1.0, default=None, metavar="SECONDS",
                        help="refresh the table in place every SECONDS (default 1) until Ctrl-C")
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
        run_kv = client.get(keys.run)
        epoch_kv = client.get(keys.epoch)
        state = VersionStore(client, job).snapshot()
    view = MembershipView.decode(epoch_kv.value) if epoch_kv is not None else None
    run = json.loads(run_kv.value) if run_kv is not None else {}
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
            "rank": view.rank_of(record.member_id) if in_epoch else None,
            "rejoined_from": record.rejoined_from, "rejoins": record.rejoins})
    for group in members.values():
        group.sort(key=lambda m: (m["layout_rank"], m["member_id"]))
    add_serving(members, state)
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
    pending = sorted(v for v in state.sources if (latest is None or v > latest) and v not in state.failed)
    return {
        "job": job,
        # {run_id, instance, started} (membership.run); keys of older versions: {run_id}
        "run_id": run.get("run_id"),
        "run_started": run.get("started"),
        "revision": state.revision,
        "epoch": view.epoch if view else None,
        "epoch_members": list(view.member_ids) if view else [],
        "leader": leader,
        "members": members,
        "out_of_job": out_of_job(members, view, state),
        "latest_committed": latest,
        "committed": committed,
        "latest_acks": acks,
        "pending_versions": pending,
        "pending": [{"version": v, "reason": pending_reason(v, pending, members, state.sources.get(v, {}),
                                                            state.acks.get(v, {}), view.epoch if view else None)}
                    for v in pending],
        "failed": [{"version": v, "cause": f.cause, "num_attempts": f.num_attempts, "epoch": f.epoch}
                   for v, f in sorted(state.failed.items())[-last:]][::-1],
    }


def add_serving(members: dict[str, list[dict[str, Any]]], state) -> None:
    """Per member: ``serving``, the newest committed version it acked in this incarnation
    (inference; None: it serves nothing yet) or the newest version it published (trainers),
    and ``lag``, how many versions behind the newest committed one it is."""
    latest = state.latest_committed
    for m in members["inference"]:
        held = [v for v, acks in state.acks.items() if v in state.committed
                and (a := acks.get(m["member_id"])) is not None and a.incarnation == m["incarnation"]]
        m["serving"] = max(held) if held else None
        m["lag"] = latest - m["serving"] if m["serving"] is not None and latest is not None else None
    for m in members["trainer"]:
        sent = [v for v, sources in state.sources.items() if sources.get(m["member_id"]) == m["incarnation"]]
        m["serving"] = max(sent) if sent else None  # the newest version it published
        m["lag"] = None


def out_of_job(members: dict[str, list[dict[str, Any]]], view, state) -> list[dict[str, Any]]:
    """Members the job counts on that hold no registration now (pure): in the epoch, acked the
    newest committed version, or source of a version not committed yet, under an incarnation
    whose member key is gone with its lease. Each is detached (alive: it registers again on its
    own, and an inference rank serves its last version meanwhile under
    ``serve_when_detached='keep'``), left or dead. A member registered again under a new incarnation
    is not listed: its row says ``rejoined_from``. ``held``: the newest committed version the
    incarnation acked (what it serves while detached)."""
    registered = {m["member_id"] for group in members.values() for m in group}
    latest = state.latest_committed
    known: dict[str, dict[str, Any]] = {}

    def note(role: str, member_id: str, incarnation: str, where: str) -> None:
        if member_id not in registered:
            known.setdefault(member_id, {"member_id": member_id, "role": role, "incarnation": incarnation,
                                         "known_from": where})

    for m in view.members if view is not None else ():
        note(m.role, m.member_id, m.incarnation, f"epoch {view.epoch}")
    for member_id, ack in state.acks.get(latest, {}).items() if latest is not None else ():
        note("inference", member_id, ack.incarnation, f"acks of v{latest}")
    for version, sources in sorted(state.sources.items()):
        if latest is None or version > latest:
            for member_id, incarnation in sources.items():
                note("trainer", member_id, incarnation, f"sources of v{version}")
    for entry in known.values():
        held = [v for v, acks in state.acks.items() if v in state.committed
                and (a := acks.get(entry["member_id"])) is not None and a.incarnation == entry["incarnation"]]
        entry["held"] = max(held) if held else None
    return sorted(known.values(), key=lambda e: (e["role"], e["member_id"]))


def pending_reason(version: int, pending: list[int], members: dict[str, list[dict[str, Any]]],
                   sources: dict[str, str], acks: dict[str, Any], epoch: int | None) -> str:
    """Why ``version`` (published, not committed) is not committed yet, in one line (pure)."""
    newest = max(pending)
    if version < newest:
        return f"superseded by v{newest}: dropped once a newer version commits"
    trainers = [m["member_id"] for m in members["trainer"] if sources.get(m["member_id"]) != m["incarnation"]]
    if trainers:
        return f"waiting for trainer(s) {', '.join(trainers)} to publish it"
    inference = members["inference"]
    if not inference:
        return "no inference member in the job to receive it"
    outside = [m["member_id"] for m in inference if not m["in_epoch"]]
    if outside:
        return (f"member(s) {', '.join(outside)} not in epoch {epoch if epoch is not None else '-'} yet: "
                f"a new epoch is forming")
    missing = [m["member_id"] for m in inference if m["member_id"] not in acks]
    if missing:
        return (f"acked by {len(inference) - len(missing)} of {len(inference)} inference members; "
                f"moving to {', '.join(missing)}")
    return "every inference member acked it: the commit is being written"


def run(args: argparse.Namespace) -> int:
    """Print the status table (or JSON)."""
    if args.watch is not None:
        return _watch(args)
    data = job_status(etcd_config(args), args.job, args.last)
    if args.json:
        print_json(data)
        return 0
    print(render_status(data))
    return 0


def _watch(args: argparse.Namespace) -> int:
    """The table, redrawn in place (cursor home, clear below) every ``args.watch`` seconds."""
    import signal
    import sys
    import threading

    if not args.watch > 0 or args.json:
        raise ValueError(f"--watch needs SECONDS > 0 and no --json, got {args.watch} {'--json' if args.json else ''}")
    config = etcd_config(args)
    # Ctrl-C sets a flag instead of raising inside an etcd call: a KeyboardInterrupt there
    # (mid-request, on a loaded machine) could leave the client's close waiting for good.
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda _signum, _frame: stop.set())
    try:
        while not stop.is_set():
            text = render_status(job_status(config, args.job, args.last))
            sys.stdout.write(f"\x1b[H\x1b[J{text}\n(every {args.watch:g} s; Ctrl-C stops)\n")
            sys.stdout.flush()
            stop.wait(args.watch)
    finally:
        signal.signal(signal.SIGINT, previous)
    return 0


def render_status(data: dict[str, Any]) -> str:
    """The human-readable status: header, members, versions, acks."""
    leader = data["leader"]
    out = [f"job {data['job']}  run {data.get('run_id') or '-'}  "
           f"epoch {data['epoch'] if data['epoch'] is not None else '-'}  "
           f"leader {leader['member_id'] + ' (token ' + str(leader['token']) + ')' if leader else '-'}  "
           f"latest committed {data['latest_committed'] if data['latest_committed'] is not None else '-'}"]
    for role in ("trainer", "inference"):
        rows = [[m["member_id"], m["incarnation"], m["host"], m["domain"], m["layout_rank"],
                 m["layout"][:12] or "-", _serving(m, role), "-" if m.get("lag") is None else m["lag"],
                 "-" if m["rank"] is None else m["rank"], _rejoined(m)]
                for m in data["members"][role]]
        out.append("")
        out.append(f"{role} ranks ({len(rows)})")
        out.append(render_table(["member", "incarnation", "host", "domain", "layout rank", "layout",
                                 "published" if role == "trainer" else "serving", "lag", "rank in epoch",
                                 "rejoined"], rows)
                   if rows else "  none")
    gone = data.get("out_of_job", [])
    if gone:
        out.append("")
        out.append(f"out of the job: lease gone ({len(gone)}): detached (comes back on its own as a new "
                   "incarnation; an inference rank serves its last version meanwhile if serve_when_detached=keep), "
                   "left or dead")
        out.append(render_table(["member", "role", "incarnation", "held", "known from"],
                                [[g["member_id"], g["role"], g["incarnation"],
                                  "-" if g["held"] is None else f"v{g['held']}", g["known_from"]] for g in gone]))
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
    for p in data.get("pending", []):
        out.append(f"\nv{p['version']} pending: {p['reason']}")
    for f in data.get("failed", []):
        how = (f"failed after {f['num_attempts']} attempt(s)" if f["num_attempts"]
               else "was refused (no attempt could succeed)")
        where = f" in epoch {f['epoch']}" if f["epoch"] >= 0 else ""
        out.append(f"\nv{f['version']} {how}{where}: {f['cause']}")
    out.append("\nepoch: the membership generation (a new one at every join, leave or death); rank in epoch: the "
               "member's rank in that epoch's communicator; rejoined: times the member's process came back as a "
               "new incarnation after its lease was lost, and the incarnation it was; serving: the newest "
               "committed version the member holds, verified; lag: versions behind the newest committed one")
    return "\n".join(out)


def _rejoined(member: dict[str, Any]) -> str:
    """How often the member's process came back after losing its lease, and from which incarnation."""
    if not member.get("rejoins"):
        return "-"
    return f"x{member['rejoins']} (was {member['rejoined_from']})"


def _serving(member: dict[str, Any], role: str) -> str:
    if member.get("serving") is None:
        return "nothing" if role == "inference" else "-"
    return f"v{member['serving']}"
