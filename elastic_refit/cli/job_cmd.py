"""`elastic-refit job reset --etcd HOST:PORT --job NAME --yes`: clear a finished job.

A job's name is its identity in etcd: its run id, its committed versions and what they
hold. A second run under the same name is refused (a version published again with other
data) or stops (a control state that is not the one its members joined); once a job is
over, ``job reset`` deletes everything under its name so that the name can start afresh.
Guarded: refused while any member of the job is registered, and without ``--yes``.
"""

from __future__ import annotations

import argparse

from elastic_refit.cli._etcd import add_etcd_arguments, etcd_config

__all__ = ["register", "reset_job", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("job", help="manage a job's state in etcd (reset a finished job)",
                                   description="Manage a job's state in etcd.")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    reset = actions.add_parser("reset", help="delete a finished job's keys (its run id, versions and commits)",
                               description="Delete every key of a finished job, so its name can be used by a "
                                           "new run. Refused while a member of the job is registered.")
    add_etcd_arguments(reset)
    reset.add_argument("--job", required=True, help="job name")
    reset.add_argument("--yes", action="store_true", help="really delete (without it: say what would go)")
    reset.set_defaults(handler=run)


def reset_job(config, job: str, *, confirm: bool) -> int:
    """Delete every key of ``job`` (``config``: an ``EtcdConfig`` or endpoints); returns how
    many went. ``ValueError`` naming why not: no such job, live members, no ``confirm``."""
    from elastic_refit.membership import EtcdClient, JobKeys

    keys = JobKeys(job)
    with EtcdClient(config) as client:
        num_keys = client.count_prefix(keys.prefix)
        if num_keys == 0:
            raise ValueError(f"no job {job!r} in this etcd (nothing under {keys.prefix})")
        members = [kv.key[len(keys.members_prefix):] for kv in client.get_prefix(keys.members_prefix).kvs]
        if members:
            raise ValueError(f"job {job!r} has {len(members)} registered member(s) ({', '.join(sorted(members)[:8])}): "
                             "stop them before resetting the job")
        if not confirm:
            raise ValueError(f"this deletes the {num_keys} keys of job {job!r} (its run id, versions and commits): "
                             "pass --yes to do it")
        client.delete_prefix(keys.prefix)
    return num_keys


def run(args: argparse.Namespace) -> int:
    num_keys = reset_job(etcd_config(args), args.job, confirm=args.yes)
    print(f"job {args.job!r} reset: {num_keys} keys deleted")
    return 0
