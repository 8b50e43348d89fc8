"""Deltas end to end: real etcd, real processes, gloo. Each version changes ~2% of the
elements of the one before; the coordinator proposes every refit as a delta to the inference
ranks that hold the latest commit verified, each committed version is checked byte for byte
on every live inference rank (and by the runtime's digests before it commits). A rank
killed mid-transfer and restarted, and a rank that joins, get full bytes until they hold a
commit, while the others keep receiving deltas."""

from __future__ import annotations

import json
import signal

import pytest

from .conftest import wait_until
from .runtime_job import KillSelf
from .test_runtime import (
    FIRST_MEMBERS,
    RecordAckedAttempts,
    assert_all_verified,
    job,  # noqa: F401 (fixture)
    member,
    version_state,
    wait_for_commit,
    wait_for_members,
)

pytestmark = pytest.mark.etcd

VERSIONS = (1, 2, 3, 4, 5)
DELTAS = {"delta_base_bytes": 1 << 20, "relay": "off"}


def _member(etcd: str, role: str, member_id: str, rank: int, **kw):
    kw.setdefault("config", DELTAS)
    return member(etcd, role, member_id, rank, versions=VERSIONS, delta_density=0.02, **kw)


def _acked(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _start(local_job, etcd, tmp_path, pause_s: float, hooks: dict | None = None) -> None:
    hooks = hooks or {}
    first = {"pause_s": pause_s, "start_with": FIRST_MEMBERS}
    local_job.start(_member(etcd, "trainer", "t0", 0, **first))
    local_job.start(_member(etcd, "trainer", "t1", 1, **first))
    local_job.start(_member(etcd, "inference", "i0", 2),
                    hook=RecordAckedAttempts("i0", etcd, str(tmp_path / "i0.jsonl")))
    local_job.start(_member(etcd, "inference", "i1", 3), hook=hooks.get("i1"))


def _deltas_to(acked: list[dict], member_id: str) -> dict[int, bool]:
    """Per version this member acked: whether its attempt sent it a delta (against the
    version before it that the job had committed)."""
    return {a["version"]: member_id in a["attempt"].get("deltas", []) for a in acked}


def test_versions_go_as_deltas_and_commit_bit_exact(etcd_server, job, tmp_path):  # noqa: F811
    etcd = etcd_server.endpoint
    _start(job, etcd, tmp_path, pause_s=0.5)
    reports = job.collect(["t0", "t1", "i0", "i1"], timeout_s=120)
    for m in ("i0", "i1"):
        assert_all_verified(reports[m], VERSIONS[-1])
    assert sorted(version_state(etcd).committed) == list(VERSIONS)
    acked = _acked(tmp_path / "i0.jsonl")
    sent = _deltas_to(acked, "i0")
    assert sent[1] is False  # nothing committed before it: full bytes
    assert all(sent[v] for v in VERSIONS[1:]), sent
    assert all(a["attempt"]["base"] == a["version"] - 1 for a in acked if a["version"] > 1), acked


def test_a_restarted_rank_catches_up_in_full_while_others_get_deltas(etcd_server, job, tmp_path):  # noqa: F811
    etcd = etcd_server.endpoint
    _start(job, etcd, tmp_path, pause_s=2.0, hooks={"i1": KillSelf("i1", version=3)})
    wait_until(lambda: job.procs["i1"].exitcode is not None, 120, "i1 to be killed in version 3", interval=0.2)
    assert job.procs["i1"].exitcode == -signal.SIGKILL
    # The restarted rank (a new incarnation) holds nothing: full bytes until it acks a commit.
    job.start(_member(etcd, "inference", "i1", 3), hook=RecordAckedAttempts("i1", etcd, str(tmp_path / "i1.jsonl")))
    reports = job.collect(["t0", "t1", "i0", "i1"], timeout_s=150)
    for m in ("i0", "i1"):
        assert_all_verified(reports[m], VERSIONS[-1])
    first = _acked(tmp_path / "i1.jsonl")[0]
    assert "i1" not in first["attempt"].get("deltas", []), first
    sent = _deltas_to(_acked(tmp_path / "i0.jsonl"), "i0")
    # i0 kept receiving deltas whenever it held the latest commit (a retry of a version
    # whose attempt it started receiving goes in full: its ack was retracted).
    assert sent[VERSIONS[-1]] and sum(sent.values()) >= len(VERSIONS) - 2, sent


def test_a_joiner_gets_full_bytes_then_deltas(etcd_server, job, tmp_path):  # noqa: F811
    etcd = etcd_server.endpoint
    _start(job, etcd, tmp_path, pause_s=3.0)
    wait_for_commit(etcd, 1)
    job.start(_member(etcd, "inference", "i2", 5), hook=RecordAckedAttempts("i2", etcd, str(tmp_path / "i2.jsonl")))
    wait_for_members(etcd, {"i2"})
    reports = job.collect(["t0", "t1", "i0", "i1", "i2"], timeout_s=150)
    for m in ("i0", "i1", "i2"):
        assert_all_verified(reports[m], VERSIONS[-1])
    acked = _acked(tmp_path / "i2.jsonl")
    assert "i2" not in acked[0]["attempt"].get("deltas", []), acked[0]
    assert any("i2" in a["attempt"].get("deltas", []) for a in acked[1:]), acked


def test_a_member_without_the_option_makes_refits_go_in_full(etcd_server, job, tmp_path):  # noqa: F811
    """delta_base_bytes set on every member but one inference rank: its record says it takes
    no deltas, so the coordinator sends every version in full (no attempt fails on it)."""
    etcd = etcd_server.endpoint
    first = {"pause_s": 0.5, "start_with": FIRST_MEMBERS}
    job.start(_member(etcd, "trainer", "t0", 0, **first))
    job.start(_member(etcd, "trainer", "t1", 1, **first))
    job.start(_member(etcd, "inference", "i0", 2), hook=RecordAckedAttempts("i0", etcd, str(tmp_path / "i0.jsonl")))
    job.start(_member(etcd, "inference", "i1", 3, config={"relay": "off"}))
    reports = job.collect(["t0", "t1", "i0", "i1"], timeout_s=120)
    for m in ("i0", "i1"):
        assert_all_verified(reports[m], VERSIONS[-1])
    assert sorted(version_state(etcd).committed) == list(VERSIONS)
    acked = _acked(tmp_path / "i0.jsonl")
    assert acked and not any(a["attempt"].get("deltas") for a in acked), acked


def test_relayed_versions_go_as_deltas(etcd_server, job, tmp_path):  # noqa: F811
    """The same job planned with relays: the relays forward the deltas to their needers."""
    etcd = etcd_server.endpoint
    relayed = {**DELTAS, "relay": "on"}
    first = {"pause_s": 0.5, "start_with": FIRST_MEMBERS, "config": relayed}
    job.start(_member(etcd, "trainer", "t0", 0, **first))
    job.start(_member(etcd, "trainer", "t1", 1, **first))
    job.start(_member(etcd, "inference", "i0", 2, config=relayed),
              hook=RecordAckedAttempts("i0", etcd, str(tmp_path / "i0.jsonl")))
    job.start(_member(etcd, "inference", "i1", 3, config=relayed))
    reports = job.collect(["t0", "t1", "i0", "i1"], timeout_s=120)
    for m in ("i0", "i1"):
        assert_all_verified(reports[m], VERSIONS[-1])
    sent = _deltas_to(_acked(tmp_path / "i0.jsonl"), "i0")
    assert all(sent[v] for v in VERSIONS[1:]), sent
