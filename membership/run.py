"""The job's run: which run created the job's control state in etcd (``JobKeys.run``).

The key holds JSON ``{run_id, instance, started}``, written once, by the job's first member,
never on a lease:

- ``run_id``: the run's public id, the user's (``RefitConfig.run_id``) or a random one;
- ``instance``: a random nonce, new each time the key is created: a wiped etcd recreates a
  user's run id, never its instance, so a member that registers again compares the instance;
- ``started``: when the key was created (UTC, ISO 8601), to say which run holds the name.

Keys written before the instance was kept hold only ``{run_id}`` (random then): their
instance is their run id.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from elastic_refit.membership.client import Compare, EtcdClient, Get, Put
from elastic_refit.membership.errors import RunClash
from elastic_refit.membership.keys import JobKeys, check_name

__all__ = ["JobRun", "job_run", "run_clash"]


def _utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class JobRun:
    """The content of a job's ``run`` key (see the module's docstring)."""

    run_id: str
    instance: str
    started: str = ""  # "" in keys written before it was kept

    def __post_init__(self) -> None:
        check_name("run_id", self.run_id)
        if not isinstance(self.instance, str) or not self.instance:
            raise ValueError(f"instance must be a non-empty string, got {self.instance!r}")
        if not isinstance(self.started, str):
            raise ValueError(f"started must be a string, got {self.started!r}")

    @classmethod
    def new(cls, run_id: str | None, now: datetime) -> JobRun:
        """A run created at ``now``: ``run_id`` (random if None) and a fresh instance."""
        return cls(run_id if run_id is not None else uuid.uuid4().hex[:12], uuid.uuid4().hex[:12],
                   now.astimezone(UTC).isoformat(timespec="seconds"))

    def encode(self) -> bytes:
        return json.dumps({"run_id": self.run_id, "instance": self.instance, "started": self.started}).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> JobRun:
        """The run of a key's value, old ``{run_id}`` keys included; ``ValueError`` if it is
        not one."""
        try:
            data = json.loads(raw)
            run_id = str(data["run_id"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"the job's run key holds no run: {raw!r}") from None
        return cls(run_id, str(data.get("instance") or run_id), str(data.get("started") or ""))


def run_clash(job: str, found: JobRun, mine: str | None) -> str | None:
    """Why a member of run ``mine`` (None: no explicit id, it joins any run) may not join
    ``job``, whose key holds ``found``; None if it may."""
    if mine is None or found.run_id == mine:
        return None
    since = f" (started {found.started})" if found.started else ""
    return (f"job {job!r} is held by run {found.run_id!r}{since}, not by this member's run {mine!r}: another "
            f"run reuses the job's name. Give this run its own job name, or `elastic-refit job reset --job {job}` "
            f"once run {found.run_id!r} has ended")


def job_run(client: EtcdClient, keys: JobKeys, run_id: str | None,
            clock: Callable[[], datetime] = _utc_now) -> JobRun:
    """The run ``keys``' job belongs to, created (as run ``run_id``, random if None) if this
    is the job's first member. ``RunClash`` if ``run_id`` is given and the job is another
    run's (see :func:`run_clash`)."""
    mine = JobRun.new(run_id, clock())
    res = client.txn([Compare(keys.run, "create", "==", 0)], [Put(keys.run, mine.encode())], [Get(keys.run)])
    if res.succeeded:
        return mine
    kv = res.gets[0][0] if res.gets and res.gets[0] else None
    if kv is None:  # deleted between the compare and the get (a job reset): ours to create
        return job_run(client, keys, run_id, clock)
    found = JobRun.decode(kv.value)
    clash = run_clash(keys.job, found, run_id)
    if clash is not None:
        raise RunClash(clash)
    return found
