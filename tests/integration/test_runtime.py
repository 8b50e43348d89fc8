"""ElasticRefit end to end: real etcd, real processes, real gloo communicators.

Every committed version is checked bit-exactly on every live inference rank; a fault
never hangs a member past the test's deadline."""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass
from typing import Any

import pytest
from elastic_refit.membership.attempts import AttemptLedger
from elastic_refit.membership.client import EtcdClient
from elastic_refit.membership.keys import JobKeys
from elastic_refit.membership.versions import VersionState, VersionStore

from elastic_refit.runtime.attempt import CATCH_UP, AttemptSpec
from elastic_refit.testing.job import MemberSpec

from .conftest import wait_until
from .runtime_job import KillSelf, LocalJob, RaiseOnce

pytestmark = pytest.mark.etcd

# Trainers 0 and 1 are data-parallel replicas; inference ranks [2, 3] and [4, 5] are two
# data-parallel replicas of a 2-way tensor-parallel engine. Tests start with 2 and 3; a
# member joining at 5 (or a restarted 3 next to a live 5) finds its shard on a peer.
SPEC = json.dumps({
    "domains": [0, 0, 1, 1, 2, 2],
    "tensors": [
        {"name": "w", "shape": [96, 64], "dtype": "bfloat16",
         "source": {"mesh": [0, 1], "placements": ["R"]},
         "destination": {"mesh": [[2, 3], [4, 5]], "placements": ["R", "S(0)"]}},
        {"name": "experts", "shape": [4, 32, 16], "dtype": "float32",
         "source": {"mesh": [[0], [1]], "placements": ["R", "S(0)"]},
         "destination": {"mesh": [[2, 3], [4, 5]], "placements": ["R", "S(1)"]}},
        {"name": "norm", "shape": [64], "dtype": "float32",
         "source": {"mesh": [0, 1], "placements": ["R"]},
         "destination": {"mesh": [[2, 3], [4, 5]], "placements": ["R", "R"]}},
    ],
})
VERSIONS = (1, 2, 3)


# The members a test starts with; trainers hold version 1 until all of them are in the
# epoch, so a fault aimed at version 2 of any one of them lands inside a transfer.
FIRST_MEMBERS = ("t0", "t1", "i0", "i1")


def member(etcd: str, role: str, member_id: str, layout_rank: int, **kw) -> MemberSpec:
    kw.setdefault("versions", VERSIONS)
    return MemberSpec("job", role, member_id, layout_rank, (etcd,), f"d{0 if role == 'trainer' else 1}",
                      spec_json=SPEC, **kw)


@pytest.fixture
def job():
    j = LocalJob()
    try:
        yield j
    finally:
        j.stop()


def start_members(job: LocalJob, etcd: str, pause_s: float = 0.0, config: dict | None = None) -> None:
    """Trainers t0, t1 (``pause_s`` between versions) and inference ranks i0, i1 (at 2, 3);
    ``config``: RefitConfig fields of all four."""
    first = {"pause_s": pause_s, "start_with": FIRST_MEMBERS}
    extra = {"config": config} if config else {}
    for m in (member(etcd, "trainer", "t0", 0, **first, **extra), member(etcd, "trainer", "t1", 1, **first, **extra),
              member(etcd, "inference", "i0", 2, **extra), member(etcd, "inference", "i1", 3, **extra)):
        job.start(m)


def assert_all_verified(report: dict, last_version: int = VERSIONS[-1]) -> None:
    assert "error" not in report, report.get("error")
    assert report["problems"] == []
    assert all(c["verified"] for c in report["committed"]), report["committed"]
    assert report["committed"][-1]["version"] == last_version


def version_state(etcd: str) -> VersionState:
    """The job's versions as the runtime reads them (one ``VersionStore`` snapshot)."""
    with EtcdClient([etcd]) as client:
        return VersionStore(client, "job").snapshot()


def wait_for_commit(etcd: str, version: int, timeout_s: float = 120) -> None:
    wait_until(lambda: version in version_state(etcd).committed, timeout_s, f"version {version} to commit",
               interval=0.2)


def wait_for_members(etcd: str, member_ids: set[str], timeout_s: float = 120) -> None:
    """Until every one of ``member_ids`` has a member record (is registered) in etcd."""
    keys = JobKeys("job")

    def registered() -> bool:
        with EtcdClient([etcd]) as client:
            found = {keys.parse_member_key(kv.key) for kv in client.get_prefix(keys.members_prefix).kvs}
        return member_ids <= {parsed[1] for parsed in found if parsed is not None}

    wait_until(registered, timeout_s, f"{sorted(member_ids)} to register", interval=0.2)


@dataclass(frozen=True)
class RecordAckedAttempts:
    """Phase hook that only observes: at ``ack.before`` of ``member_id`` it appends the
    attempt being acked, as the epoch's coordinator proposed it in etcd, to ``path`` (one
    JSON object a line: version, epoch, seq, attempt)."""

    member_id: str
    etcd: str
    path: str

    def __call__(self, phase: str, context: dict[str, Any]) -> None:
        if phase != "ack.before" or context["member_id"] != self.member_id:
            return
        with EtcdClient([self.etcd]) as client:
            attempt = AttemptLedger(VersionStore(client, "job")).attempt(context["epoch"], context["seq"]).to_json()
        record = {k: context[k] for k in ("version", "epoch", "seq")}
        with open(self.path, "a") as out:
            out.write(json.dumps({**record, "attempt": attempt}) + "\n")


def test_versions_commit_bit_exact(etcd_server, job):
    etcd = etcd_server.endpoint
    # Connecting ahead runs on gloo only when asked ("auto" is NCCL only): asked here, so the
    # CPU suite runs its agreement and its batches too; and relayed plans (ingress balance).
    start_members(job, etcd, config={"connect_ahead": "on", "relay": True})
    reports = job.collect(["t0", "t1", "i0", "i1"], timeout_s=90)
    for m in ("i0", "i1"):
        assert_all_verified(reports[m])
    for m in ("t0", "t1"):
        assert [c["version"] for c in reports[m]["committed"]] == list(VERSIONS)
    assert sorted(version_state(etcd).committed) == list(VERSIONS)
    # every member connected its plan's pairs on entering the epoch of all four, and the
    # versions committed bit-exact afterwards (above)
    assert all(reports[m]["stats"]["connected_ahead"] >= 1 for m in reports), \
        {m: r["stats"] for m, r in reports.items()}
    # and the inference ranks bound their executors to their incoming buffers then
    # (Executor.warm: the epoch's first refit only launches; a trainer binds the buffers it
    # last published, none before its first publish)
    assert all(reports[m]["stats"]["warmed_buckets"] >= 1 for m in ("i0", "i1")), \
        {m: r["stats"] for m, r in reports.items()}


def test_an_attempt_failing_on_one_rank_before_it_plans_fails_fast_everywhere(etcd_server, job):
    """A rank whose attempt fails before it published its plan (a planning bug, bad input)
    marks the agreement failed: its peers retry at once instead of waiting the epoch deadline
    (raised to 30 s here, far above the second or so a retry takes) for its fingerprint."""
    etcd = etcd_server.endpoint
    slow = {"config": {"epoch_deadline_s": 30.0}}
    for m in (member(etcd, "trainer", "t0", 0, start_with=FIRST_MEMBERS, **slow),
              member(etcd, "trainer", "t1", 1, start_with=FIRST_MEMBERS, **slow),
              member(etcd, "inference", "i0", 2, **slow)):
        job.start(m)
    job.start(member(etcd, "inference", "i1", 3, **slow), hook=RaiseOnce("i1", version=2))
    reports = job.collect(["t0", "t1", "i0", "i1"], timeout_s=90)
    for m in ("i0", "i1"):
        assert_all_verified(reports[m])
    assert reports["i1"]["stats"]["failed_attempts"] >= 1
    version_2 = next(c for c in reports["t0"]["committed"] if c["version"] == 2)
    assert version_2["seconds"] < 15.0, f"version 2 took {version_2['seconds']:.1f} s: peers waited for the plan"


def test_inference_rank_killed_mid_transfer(etcd_server, job):
    etcd = etcd_server.endpoint
    for m in (member(etcd, "trainer", "t0", 0, start_with=FIRST_MEMBERS),
              member(etcd, "trainer", "t1", 1, start_with=FIRST_MEMBERS), member(etcd, "inference", "i0", 2)):
        job.start(m)
    job.start(member(etcd, "inference", "i1", 3), hook=KillSelf("i1", version=2))
    start = time.monotonic()
    reports = job.collect(["t0", "t1", "i0"], timeout_s=120)
    assert job.procs["i1"].exitcode == -signal.SIGKILL
    assert_all_verified(reports["i0"])
    # the version in flight committed on the survivors, once
    committed = version_state(etcd).committed
    assert sorted(committed) == list(VERSIONS)
    assert committed[2].epoch > committed[1].epoch
    assert time.monotonic() - start < 120


def test_trainer_rank_killed_mid_transfer(etcd_server, job):
    etcd = etcd_server.endpoint
    job.start(member(etcd, "trainer", "t0", 0, start_with=FIRST_MEMBERS))
    job.start(member(etcd, "trainer", "t1", 1, start_with=FIRST_MEMBERS), hook=KillSelf("t1", version=2))
    for m in (member(etcd, "inference", "i0", 2), member(etcd, "inference", "i1", 3)):
        job.start(m)
    reports = job.collect(["t0", "i0", "i1"], timeout_s=120)
    assert job.procs["t1"].exitcode == -signal.SIGKILL
    for m in ("i0", "i1"):
        assert_all_verified(reports[m])
    assert [c["version"] for c in reports["t0"]["committed"]] == list(VERSIONS)


def test_rank_joining_mid_run_catches_up(etcd_server, job):
    """A rank joining (at 5) while the trainers run ends with the last version, verified.
    The trainers pause 4 s between versions, so the join (a second or two, a few on a
    loaded machine) lands before the run is over."""
    etcd = etcd_server.endpoint
    start_members(job, etcd, pause_s=4.0)
    wait_for_commit(etcd, 1)
    job.start(member(etcd, "inference", "i2", 5))
    wait_for_members(etcd, {"i2"})
    assert VERSIONS[-1] not in version_state(etcd).committed, "i2 joined after the run was over"
    reports = job.collect(["t0", "t1", "i0", "i1", "i2"], timeout_s=120)
    for m in ("i0", "i1", "i2"):
        assert_all_verified(reports[m])
    assert reports["i2"]["committed"][0]["version"] >= 1


@pytest.mark.parametrize("arrival", ["restart", "join"])
def test_rank_arriving_without_trainers_catches_up_from_its_peers(etcd_server, job, tmp_path, arrival):
    """An inference rank that restarts (3, next to a live 5) or joins (5, next to a live 3)
    while no trainer is alive gets the latest committed version from its peers: the attempt
    it acks is a catch-up whose only senders are inference holders. Trainers that come back
    afterwards move the next versions to every rank."""
    etcd = etcd_server.endpoint
    patient = {"config": {"version_timeout_s": 600.0}}  # the test's own deadlines bound the waits
    peers = {"i0": 2, "i2": 5} if arrival == "restart" else {"i0": 2, "i1": 3}
    newcomer, rank = ("i1", 3) if arrival == "restart" else ("i2", 5)
    for peer, peer_rank in peers.items():
        job.start(member(etcd, "inference", peer, peer_rank, **patient))
    if arrival == "restart":
        job.start(member(etcd, "inference", newcomer, rank, incarnation="first", **patient))
    # Every inference rank is in before the trainers come, so version 1 reaches all of them;
    # the trainers see it committed and leave: from here on only inference ranks hold weights.
    wait_for_members(etcd, {*peers, newcomer} if arrival == "restart" else set(peers))
    for trainer, trainer_rank in (("t0", 0), ("t1", 1)):
        job.start(member(etcd, "trainer", trainer, trainer_rank, versions=(1,)))
    first_trainers = job.collect(["t0", "t1"], timeout_s=120)
    for report in first_trainers.values():
        assert [c["version"] for c in report["committed"]] == [1], report
    if arrival == "restart":
        job.signal(newcomer, signal.SIGKILL)
        job.procs[newcomer].join(30)
        assert job.procs[newcomer].exitcode == -signal.SIGKILL
    acked = tmp_path / "acked.jsonl"
    job.start(member(etcd, "inference", newcomer, rank, incarnation="second", **patient),
              hook=RecordAckedAttempts(newcomer, etcd, str(acked)))

    def caught_up() -> bool:
        ack = version_state(etcd).acks.get(1, {}).get(newcomer)
        return ack is not None and ack.incarnation == "second"

    wait_until(caught_up, 120, f"{newcomer} (second incarnation) to hold version 1", interval=0.2)
    record = json.loads(acked.read_text().splitlines()[0])
    assert record["version"] == 1 and record["attempt"] is not None, record
    spec = AttemptSpec.from_json(record["attempt"])
    assert spec.kind == CATCH_UP, spec
    assert spec.sources == (), f"trainers fed {newcomer}: {spec}"
    assert newcomer in spec.destinations and spec.holders, spec
    assert set(spec.participants) <= {*peers, newcomer}, f"a trainer took part in the catch-up: {spec}"

    for trainer, trainer_rank in (("t0b", 0), ("t1b", 1)):
        job.start(member(etcd, "trainer", trainer, trainer_rank, versions=(2, 3)))
    reports = job.collect([*peers, newcomer, "t0b", "t1b"], timeout_s=180)
    for m in (*peers, newcomer):
        assert_all_verified(reports[m])
    assert reports[newcomer]["committed"][0]["version"] == 1  # served first what its peers sent


def test_stale_rank_is_fenced_and_rejoins_as_a_new_incarnation(etcd_server, job):
    """i1 frozen past its lease TTL: etcd drops its record and the others go on without it;
    thawed, its old incarnation writes nothing (its lease is gone) and it comes back on its
    own as a new incarnation, in the same process, and serves the last version verified."""
    etcd = etcd_server.endpoint
    start_members(job, etcd, pause_s=1.0)
    wait_for_commit(etcd, 1)
    i1_key = JobKeys("job").member("inference", "i1")
    with EtcdClient([etcd]) as client:
        frozen = json.loads(client.get(i1_key).value)["incarnation"]
        job.signal("i1", signal.SIGSTOP)
        try:
            wait_until(lambda: client.get(i1_key) is None, 60, "the frozen i1's lease to expire", interval=0.2)
        finally:
            job.signal("i1", signal.SIGCONT)
        wait_until(lambda: (kv := client.get(i1_key)) is not None and json.loads(kv.value)["incarnation"] != frozen,
                   30, "i1 to rejoin as a new incarnation", interval=0.1)
    reports = job.collect(["t0", "t1", "i0", "i1"], timeout_s=120)
    assert_all_verified(reports["i0"])
    assert_all_verified(reports["i1"])
    assert sorted(version_state(etcd).committed) == list(VERSIONS)


def test_staged_mode_swaps_committed_versions(etcd_server, job):
    # Staged inference receives into spare buffers and swaps on commit; with a trainer
    # killed mid-transfer the served weights are never torn.
    etcd = etcd_server.endpoint
    job.start(member(etcd, "trainer", "t0", 0, start_with=FIRST_MEMBERS))
    job.start(member(etcd, "trainer", "t1", 1, start_with=FIRST_MEMBERS), hook=KillSelf("t1", version=2))
    for m in (member(etcd, "inference", "i0", 2, mode="staged"), member(etcd, "inference", "i1", 3, mode="staged")):
        job.start(m)
    reports = job.collect(["t0", "i0", "i1"], timeout_s=120)
    for m in ("i0", "i1"):
        assert_all_verified(reports[m])
    assert sorted(version_state(etcd).committed) == list(VERSIONS)
