"""``ElasticRefit`` into an FP8 inference side on NCCL: the job of
``tests/integration/test_runtime_fp8.py`` with every member a process on the GPU (each a host
of its own to NCCL, ``nccl_rank_env``), a real etcd. Trainers publish BF16 on the GPU and
quantize there (the fused kernel on whole blocks, the torch path on blocks their TP shards
split, after the partial-amax exchange); inference ranks hold FP8 weights and float32 scales
on the GPU, every byte of every committed version checked against the CPU reference
quantizer. A rank that joins afterwards catches up from its FP8 peers over NCCL."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from elastic_refit.runtime.attempt import CATCH_UP, AttemptSpec
from elastic_refit.testing.etcd import EtcdServer
from elastic_refit.testing.processes import nccl_rank_env
from tests.integration.conftest import wait_until
from tests.integration.runtime_job import LocalJob
from tests.integration.test_runtime import (
    RecordAckedAttempts,
    assert_all_verified,
    version_state,
    wait_for_members,
)
from tests.integration.test_runtime_fp8 import FIRST_MEMBERS, VERSIONS, member

pytestmark = [pytest.mark.gpu, pytest.mark.etcd]

BACKEND = "nccl4py" if importlib.util.find_spec("nccl") is not None else "nccl"
GPU = {"backend": BACKEND, "device": "cuda:0", "verify": True, "version_timeout_s": 300.0}
# NCCL host of each member (one per live process; t0b and t1b come after t0 and t1 left)
RANKS = {"t0": 0, "t1": 1, "i0": 2, "i1": 3, "i2": 4, "t0b": 0, "t1b": 1}


@pytest.fixture
def etcd_server():
    """A fresh single-node etcd on free loopback ports (the integration tests' fixture)."""
    server = EtcdServer(name="gpu-fp8")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def job():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    j = LocalJob()
    try:
        yield j
    finally:
        j.stop()


def start(job: LocalJob, spec, hook=None) -> None:
    """Start ``spec`` with the NCCL environment of its own host (the child copies it)."""
    saved = dict(os.environ)
    os.environ.update(nccl_rank_env(RANKS[spec.member_id]))
    try:
        job.start(spec, hook=hook)
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.timeout(420)  # each member starts CUDA and compiles its kernels
def test_nccl_fp8_versions_commit_and_every_destination_byte_matches_the_reference(etcd_server, job):
    etcd = etcd_server.endpoint
    for name, rank in (("i0", 2), ("i1", 3)):
        start(job, member(etcd, "inference", name, rank, config=GPU))
    for name, rank in (("t0", 0), ("t1", 1)):
        start(job, member(etcd, "trainer", name, rank, start_with=FIRST_MEMBERS, config=GPU))
    reports = job.collect(["t0", "t1", "i0", "i1"], timeout_s=300)
    for m in ("t0", "t1"):
        assert "error" not in reports[m], reports[m].get("error")
        assert [c["version"] for c in reports[m]["committed"]] == list(VERSIONS)
    for m in ("i0", "i1"):
        assert_all_verified(reports[m])
    assert sorted(version_state(etcd).committed) == list(VERSIONS)


@pytest.mark.timeout(540)
def test_nccl_fp8_joiner_catches_up_from_its_fp8_peers(etcd_server, job, tmp_path):
    etcd = etcd_server.endpoint
    patient = {**GPU, "version_timeout_s": 600.0}
    for name, rank in (("i0", 2), ("i1", 3)):
        start(job, member(etcd, "inference", name, rank, config=patient))
    wait_for_members(etcd, {"i0", "i1"})
    for name, rank in (("t0", 0), ("t1", 1)):
        start(job, member(etcd, "trainer", name, rank, versions=(1,), config=GPU))
    for report in job.collect(["t0", "t1"], timeout_s=300).values():
        assert [c["version"] for c in report["committed"]] == [1], report
    acked = tmp_path / "acked.jsonl"
    start(job, member(etcd, "inference", "i2", 5, config=patient), hook=RecordAckedAttempts("i2", etcd, str(acked)))
    wait_until(lambda: "i2" in version_state(etcd).acks.get(1, {}), 180, "i2 to hold version 1", interval=0.5)
    spec = AttemptSpec.from_json(json.loads(acked.read_text().splitlines()[0])["attempt"])
    assert spec.kind == CATCH_UP and spec.sources == () and spec.destinations == ("i2",) and spec.holders, spec
    for name, rank in (("t0b", 0), ("t1b", 1)):
        start(job, member(etcd, "trainer", name, rank, versions=(2, 3), config=GPU))
    reports = job.collect(["i0", "i1", "i2", "t0b", "t1b"], timeout_s=300)
    for m in ("i0", "i1", "i2"):
        assert_all_verified(reports[m])
    assert reports["i2"]["committed"][0]["version"] == 1
