"""FP32 published into a BF16 destination, end to end: real etcd, real processes, gloo.

The trainer holds ``w`` and ``norm`` in float32, the inference ranks (a 2-way tensor-parallel
engine) declare them bfloat16; ``bias`` stays float32 on both sides. Every committed version
of every inference rank is checked element by element against the trainer's float32 pattern
``.to(bfloat16)``, and the trainer's schedule moves the destination's bytes (BF16 for the
cast tensors), not its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from elastic_refit.layout import parse_spec
from elastic_refit.plan import make_plan
from elastic_refit.runtime.attempt import AttemptSpec
from elastic_refit.testing.job import MemberSpec

from .runtime_job import LocalJob, RaiseOnce
from .test_runtime import RecordAckedAttempts, assert_all_verified, version_state

pytestmark = pytest.mark.etcd

VERSIONS = (1, 2, 3)
SPEC = json.dumps({"domains": [0, 1, 1], "tensors": [
    {"name": "w", "shape": [64, 48], "source": {"mesh": [0], "placements": ["R"], "dtype": "float32"},
     "destination": {"mesh": [1, 2], "placements": ["S(0)"], "dtype": "bfloat16"}},
    {"name": "norm", "shape": [48], "source": {"mesh": [0], "placements": ["R"], "dtype": "float32"},
     "destination": {"mesh": [1, 2], "placements": ["R"], "dtype": "bfloat16"}},
    {"name": "bias", "shape": [24], "dtype": "float32", "source": {"mesh": [0], "placements": ["R"]},
     "destination": {"mesh": [1, 2], "placements": ["S(0)"]}},
]})
PARSED = parse_spec(json.loads(SPEC))
BF16_BYTES = (64 * 48 + 48) * 2  # what crosses to the engine's domain of the cast tensors, once
FP32_BYTES = 24 * 4


@dataclass(frozen=True)
class RecordWire:
    """Phase hook: at ``transfer.before`` of ``member_id``, what its executor will send
    (bytes, the dtypes its cast buffers travel in) as one JSON line in ``path``."""

    member_id: str
    path: str

    def __call__(self, phase: str, context: dict[str, Any]) -> None:
        if phase != "transfer.before" or context["member_id"] != self.member_id:
            return
        executor = context["executor"]
        cast = executor.plan.cast
        with open(self.path, "a") as out:
            out.write(json.dumps({"version": context["version"], "send_bytes": executor.schedule.send_bytes,
                                  "cast": cast.describe() if cast is not None else None,
                                  "wire": sorted(set(executor.schedule.wire_dtypes.values()))}) + "\n")


def member(etcd: str, role: str, member_id: str, layout_rank: int, **kw) -> MemberSpec:
    kw.setdefault("versions", VERSIONS)
    kw["config"] = {"verify": True, **kw.get("config", {})}
    return MemberSpec("job", role, member_id, layout_rank, (etcd,), f"d{0 if role == 'trainer' else 1}",
                      spec_json=SPEC, **kw)


@pytest.fixture
def job():
    j = LocalJob()
    try:
        yield j
    finally:
        j.stop()


def test_the_plan_moves_bf16_where_the_engine_declares_it():
    plan = make_plan(PARSED.source, PARSED.destination, PARSED.topology)
    assert plan.cast is not None and plan.cast.describe() == "2 tensor(s) float32 -> bfloat16"
    assert plan.stats.cross_domain_bytes == plan.stats.lower_bound_bytes == BF16_BYTES + FP32_BYTES


def test_fp32_published_into_bf16_lands_bit_exact(etcd_server, job, tmp_path):
    etcd = etcd_server.endpoint
    wire = tmp_path / "wire.jsonl"
    job.start(member(etcd, "trainer", "t0", 0, start_with=("t0", "i0", "i1")), hook=RecordWire("t0", str(wire)))
    for m, rank in (("i0", 1), ("i1", 2)):
        job.start(member(etcd, "inference", m, rank))
    reports = job.collect(["t0", "i0", "i1"], timeout_s=120)
    for m in ("i0", "i1"):
        assert_all_verified(reports[m], VERSIONS[-1])
        assert all(c["checked"] for c in reports[m]["committed"])  # each element == pattern.to(bfloat16)
    assert [c["version"] for c in reports["t0"]["committed"]] == list(VERSIONS)
    assert sorted(version_state(etcd).committed) == list(VERSIONS)
    sent = [json.loads(line) for line in wire.read_text().splitlines()]
    assert {s["version"] for s in sent} == set(VERSIONS)
    for s in sent:  # the bytes on the wire are the destination's
        assert s == {**s, "send_bytes": BF16_BYTES + FP32_BYTES, "cast": "2 tensor(s) float32 -> bfloat16",
                     "wire": ["bfloat16"]}, s


def test_bf16_holders_receive_again_instead_of_sending_beside_fp32_trainers(etcd_server, job, tmp_path):
    """i1 fails version 2 after its bytes arrived (before its ack) while i0 acks it: the retry
    has a holder (i0) in BF16, which cannot send beside the FP32 trainer, so it receives the
    version again with i1 (not a version refused as unplannable), and both end bit-exact."""
    etcd = etcd_server.endpoint
    acked = tmp_path / "acked.jsonl"
    job.start(member(etcd, "trainer", "t0", 0, start_with=("t0", "i0", "i1")))
    job.start(member(etcd, "inference", "i0", 1), hook=RecordAckedAttempts("i0", etcd, str(acked)))
    job.start(member(etcd, "inference", "i1", 2), hook=RaiseOnce("i1", version=2, phase="ack.before"))
    reports = job.collect(["t0", "i0", "i1"], timeout_s=120)
    for m in ("i0", "i1"):
        assert_all_verified(reports[m], VERSIONS[-1])
    assert reports["i1"]["stats"]["failed_attempts"] >= 1
    attempts = [AttemptSpec.from_json(json.loads(line)["attempt"]) for line in acked.read_text().splitlines()
                if json.loads(line)["version"] == 2]
    assert len(attempts) >= 2, attempts
    again = attempts[-1]
    assert again.holders == () and {"i0", "i1"} <= set(again.destinations) and again.sources == ("t0",), again
