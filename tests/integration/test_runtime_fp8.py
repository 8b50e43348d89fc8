"""ElasticRefit into an FP8 inference side, end to end: real etcd, real processes, gloo.

The inference ranks declare ``fp8-block128`` for the attention's linear weights (the
DeepSeek-V3 checkpoint layout: a ``float8_e4m3fn`` weight and a float32 ``weight_scale_inv``
per 128 x 128 block), ``mxfp8`` for the stacked experts (uint8 E8M0 ``weight_scale`` per 32
elements of a row) and BF16 for the rest; the trainers publish BF16 as ever. The trainers' TP
shards cut blocks (160 rows of 320; 40 expert columns of 80), so do the inference ranks' (144
of 288): blocks split across senders are quantized through the partial-amax exchange. Every destination byte of every
committed version, FP8 weights and scales included, is checked against
``kernels.quantize.quantize_reference`` of the whole published BF16 tensor.
"""

from __future__ import annotations

import json
import signal

import pytest
import torch

from elastic_refit.layout import TensorFormats, parse_spec
from elastic_refit.plan import destination_format_layout
from elastic_refit.runtime import ElasticRefit, RefitConfig, RefitLayouts
from elastic_refit.runtime.attempt import CATCH_UP, AttemptSpec
from elastic_refit.testing.job import MemberSpec
from elastic_refit.testing.pattern import allocate

from .conftest import wait_until
from .runtime_job import KillSelf, LocalJob, RaiseOnce
from .test_runtime import RecordAckedAttempts, assert_all_verified, version_state, wait_for_members

pytestmark = pytest.mark.etcd

QKV, O_PROJ = "layers.0.self_attn.qkv_proj.weight", "layers.0.self_attn.o_proj.weight"
EXPERTS = "layers.0.mlp.experts.down_proj.weight"
# Trainers 0 and 1: tensor-parallel (tp=2). Inference ranks [2, 3] and [4, 5]: two
# data-parallel replicas of a tp=2 engine. Tests start 2 and 3; a rank joining at 5 finds its
# shards on 3.
SPEC = json.dumps({
    "domains": [0, 0, 1, 1, 2, 2],
    "tensors": [
        {"name": QKV, "shape": [320, 288], "dtype": "bfloat16",
         "source": {"mesh": [0, 1], "placements": ["S(0)"]},
         "destination": {"mesh": [[2, 3], [4, 5]], "placements": ["R", "S(1)"], "format": "fp8-block128"}},
        {"name": O_PROJ, "shape": [288, 320], "dtype": "bfloat16",
         "source": {"mesh": [0, 1], "placements": ["S(1)"]},
         "destination": {"mesh": [[2, 3], [4, 5]], "placements": ["R", "S(0)"], "format": "fp8-block128"}},
        {"name": EXPERTS, "shape": [4, 96, 80], "dtype": "bfloat16",
         "source": {"mesh": [0, 1], "placements": ["S(2)"]},
         "destination": {"mesh": [[2, 3], [4, 5]], "placements": ["R", "S(0)"], "format": "mxfp8"}},
        {"name": "layers.0.input_layernorm.weight", "shape": [288], "dtype": "bfloat16",
         "source": {"mesh": [0, 1], "placements": ["R"]},
         "destination": {"mesh": [[2, 3], [4, 5]], "placements": ["R", "R"]}},
        {"name": "embed_tokens.weight", "shape": [64, 288], "dtype": "bfloat16",
         "source": {"mesh": [0, 1], "placements": ["S(0)"]},
         "destination": {"mesh": [[2, 3], [4, 5]], "placements": ["R", "S(0)"]}},
    ],
})
PARSED = parse_spec(json.loads(SPEC))
FORMATS = PARSED.destination_formats
VERSIONS = (1, 2, 3)
FIRST_MEMBERS = ("t0", "t1", "i0", "i1")


def member(etcd: str, role: str, member_id: str, layout_rank: int, **kw) -> MemberSpec:
    kw.setdefault("versions", VERSIONS)
    kw.setdefault("config", {})
    kw["config"] = {"verify": True, **kw["config"]}
    return MemberSpec("job", role, member_id, layout_rank, (etcd,), f"d{0 if role == 'trainer' else 1}",
                      spec_json=SPEC, **kw)


@pytest.fixture
def job():
    j = LocalJob()
    try:
        yield j
    finally:
        j.stop()


def test_the_spec_declares_fp8_on_the_linear_weights_whose_shards_cut_blocks():
    assert {n: f.name for n, f in FORMATS.as_dict().items()} == {QKV: "fp8-block128", O_PROJ: "fp8-block128",
                                                                  EXPERTS: "mxfp8"}
    held = destination_format_layout(PARSED.destination, FORMATS)
    buffers = {b.name: (b.shape, b.dtype) for b in held.buffers(2)}
    assert buffers[QKV] == ((320, 144), "float8_e4m3fn")
    assert buffers[QKV + "_scale_inv"] == ((3, 2), "float32")  # 144 columns touch 2 column blocks
    assert buffers[O_PROJ] == ((144, 320), "float8_e4m3fn")
    assert buffers[EXPERTS] == ((2, 96, 80), "float8_e4m3fn")
    assert buffers[EXPERTS + "_scale"] == ((2, 96, 3), "uint8")  # E8M0 codes, one per 32 of a row
    assert buffers["embed_tokens.weight"] == ((32, 288), "bfloat16")


def test_fp8_versions_commit_and_every_destination_byte_matches_the_reference_quantizer(etcd_server, job):
    etcd = etcd_server.endpoint
    for m in (member(etcd, "trainer", "t0", 0, start_with=FIRST_MEMBERS),
              member(etcd, "trainer", "t1", 1, start_with=FIRST_MEMBERS),
              member(etcd, "inference", "i0", 2), member(etcd, "inference", "i1", 3)):
        job.start(m)
    reports = job.collect(["t0", "t1", "i0", "i1"], timeout_s=120)
    for m in ("i0", "i1"):
        assert_all_verified(reports[m])
        assert all(c["checked"] for c in reports[m]["committed"])
    for m in ("t0", "t1"):
        assert "error" not in reports[m], reports[m].get("error")
        assert [c["version"] for c in reports[m]["committed"]] == list(VERSIONS)
    assert sorted(version_state(etcd).committed) == list(VERSIONS)


def test_an_fp8_rank_killed_mid_transfer_leaves_the_survivor_bit_exact(etcd_server, job):
    """i1 dies in the attempt of version 2, once the plan is agreed and before its transfer
    (the trainers are quantizing and sending to it): the attempt fails everywhere, the epoch without i1 re-plans the version into i0 alone (the trainers
    quantize again, with the partial-amax exchange), and it commits, every byte checked."""
    etcd = etcd_server.endpoint
    for m in (member(etcd, "trainer", "t0", 0, start_with=FIRST_MEMBERS),
              member(etcd, "trainer", "t1", 1, start_with=FIRST_MEMBERS), member(etcd, "inference", "i0", 2)):
        job.start(m)
    job.start(member(etcd, "inference", "i1", 3), hook=KillSelf("i1", version=2))
    reports = job.collect(["t0", "t1", "i0"], timeout_s=120)
    assert job.procs["i1"].exitcode == -signal.SIGKILL
    assert_all_verified(reports["i0"])
    committed = version_state(etcd).committed
    assert sorted(committed) == list(VERSIONS)
    assert committed[2].epoch > committed[1].epoch


def test_a_joining_fp8_rank_catches_up_from_its_fp8_peers(etcd_server, job, tmp_path):
    """Version 1 reaches i0 and i1, the trainers leave; i2 joins (at 5, the shards of 3) and
    gets version 1 from its FP8 peers (a catch-up whose only senders are holders: their FP8
    bytes and scales move as they are); new trainers then move versions 2 and 3 to all
    three, quantizing on the way."""
    etcd = etcd_server.endpoint
    patient = {"config": {"version_timeout_s": 600.0}}  # the test's own deadlines bound the waits
    for peer, rank in (("i0", 2), ("i1", 3)):
        job.start(member(etcd, "inference", peer, rank, **patient))
    wait_for_members(etcd, {"i0", "i1"})
    for trainer, rank in (("t0", 0), ("t1", 1)):
        job.start(member(etcd, "trainer", trainer, rank, versions=(1,)))
    for report in job.collect(["t0", "t1"], timeout_s=120).values():
        assert [c["version"] for c in report["committed"]] == [1], report
    acked = tmp_path / "acked.jsonl"
    job.start(member(etcd, "inference", "i2", 5, **patient), hook=RecordAckedAttempts("i2", etcd, str(acked)))
    wait_until(lambda: "i2" in version_state(etcd).acks.get(1, {}), 120, "i2 to hold version 1", interval=0.2)
    spec = AttemptSpec.from_json(json.loads(acked.read_text().splitlines()[0])["attempt"])
    assert spec.kind == CATCH_UP and spec.sources == () and spec.destinations == ("i2",), spec
    assert set(spec.holders) <= {"i0", "i1"} and spec.holders, spec

    for trainer, rank in (("t0b", 0), ("t1b", 1)):
        job.start(member(etcd, "trainer", trainer, rank, versions=(2, 3)))
    reports = job.collect(["i0", "i1", "i2", "t0b", "t1b"], timeout_s=180)
    for m in ("i0", "i1", "i2"):
        assert_all_verified(reports[m])
    assert reports["i2"]["committed"][0]["version"] == 1  # checked against the reference too


def test_fp8_holders_of_a_version_receive_it_again_instead_of_sending_beside_the_trainers(etcd_server, job, tmp_path):
    """i1 fails version 2 after its bytes arrived (before its ack) while i0 acks it: the
    retry has a holder (i0) in FP8, which cannot send beside the BF16 trainers, so it
    receives the version again with i1, and both end bit-exact."""
    etcd = etcd_server.endpoint
    acked = tmp_path / "acked.jsonl"
    for m in (member(etcd, "trainer", "t0", 0, start_with=FIRST_MEMBERS),
              member(etcd, "trainer", "t1", 1, start_with=FIRST_MEMBERS)):
        job.start(m)
    job.start(member(etcd, "inference", "i0", 2), hook=RecordAckedAttempts("i0", etcd, str(acked)))
    job.start(member(etcd, "inference", "i1", 3), hook=RaiseOnce("i1", version=2, phase="ack.before"))
    reports = job.collect(["t0", "t1", "i0", "i1"], timeout_s=120)
    for m in ("i0", "i1"):
        assert_all_verified(reports[m])
    assert reports["i1"]["stats"]["failed_attempts"] >= 1
    attempts = [AttemptSpec.from_json(json.loads(line)["attempt"]) for line in acked.read_text().splitlines()
                if json.loads(line)["version"] == 2]
    assert len(attempts) >= 2, attempts  # i0 acked version 2, then received it again
    again = attempts[-1]
    assert again.holders == () and {"i0", "i1"} <= set(again.destinations) and again.sources == ("t0", "t1"), again


def test_inference_members_with_different_formats_are_refused_naming_both(etcd_server, job):
    """i0 serves the linear weights in FP8, i1 in BF16: no plan can serve both, so the
    coordinator refuses the version before any byte moves, and the trainers' publish raises
    with a cause that names both members."""
    etcd = etcd_server.endpoint
    for m in (member(etcd, "trainer", "t0", 0, start_with=FIRST_MEMBERS, versions=(1,)),
              member(etcd, "trainer", "t1", 1, start_with=FIRST_MEMBERS, versions=(1,)),
              member(etcd, "inference", "i0", 2),
              member(etcd, "inference", "i1", 3, formats_json=TensorFormats().to_json())):
        job.start(m)
    reports = job.collect(["t0", "t1"], timeout_s=120)
    for m in ("t0", "t1"):
        assert reports[m].get("error_type") == "RefitFailed", reports[m]
        assert "inference members 'i0' and 'i1' declare different destination formats" in reports[m]["error"]
        assert "fp8-block128 on 2 tensor(s), mxfp8 on 1 tensor(s)" in reports[m]["error"]
        assert "i1: bf16 throughout" in reports[m]["error"]
    failure = version_state(etcd).failed[1]
    assert "'i0' and 'i1'" in failure.cause
    assert 1 not in version_state(etcd).committed


def _config(member_id: str = "i0") -> RefitConfig:
    return RefitConfig(job="job", role="inference", member_id=member_id, layout_rank=2, etcd=("127.0.0.1:2379",))


def _parameters() -> dict[str, torch.Tensor]:
    return allocate(destination_format_layout(PARSED.destination, FORMATS), 2)


PREFIX = "inference rank 'i0': parameter"
BAD_PARAMETERS = [
    ("scale shape", {QKV + "_scale_inv": torch.zeros(3, 3)},
     f"{PREFIX} '{QKV}_scale_inv' is [3, 3] torch.float32, the layout says [3, 2] float32 "
     f"(the scales of FP8 buffer '{QKV}', one per block)"),
    ("scale dtype", {QKV + "_scale_inv": torch.zeros(3, 2, dtype=torch.bfloat16)},
     f"{PREFIX} '{QKV}_scale_inv' is [3, 2] torch.bfloat16, the layout says [3, 2] float32 "
     f"(the scales of FP8 buffer '{QKV}', one per block)"),
    ("bf16 weight", {QKV: torch.zeros(320, 144, dtype=torch.bfloat16)},
     f"{PREFIX} '{QKV}' is [320, 144] torch.bfloat16, the layout says [320, 144] float8_e4m3fn "
     "(FP8 weights: a tensor declared in formats)"),
    ("no scales", {QKV + "_scale_inv": None}, f"{PREFIX} '{QKV}_scale_inv' is missing"),
    ("float32 e8m0", {EXPERTS + "_scale": torch.zeros(2, 96, 3)},
     f"{PREFIX} '{EXPERTS}_scale' is [2, 96, 3] torch.float32, the layout says [2, 96, 3] uint8 "
     f"(the scales of FP8 buffer '{EXPERTS}', one per block)"),
    ("strided", {QKV: torch.zeros(144, 320, dtype=torch.float8_e4m3fn).t()}, f"{PREFIX} '{QKV}' must be contiguous"),
]


@pytest.mark.parametrize(("name", "changes", "message"), BAD_PARAMETERS, ids=[c[0] for c in BAD_PARAMETERS])
def test_fp8_parameters_are_checked_when_the_refit_is_built(name, changes, message):
    parameters = _parameters()
    for key, value in changes.items():
        if value is None:
            del parameters[key]
        else:
            parameters[key] = value
    with pytest.raises(ValueError) as info:
        ElasticRefit(_config(), RefitLayouts(PARSED.source, PARSED.destination), parameters=parameters,
                     formats=FORMATS)
    assert str(info.value) == message


def test_fp8_scales_sharing_memory_and_bad_formats_are_refused():
    layouts = RefitLayouts(PARSED.source, PARSED.destination)
    parameters = _parameters()
    scales = parameters[O_PROJ + "_scale_inv"]
    parameters[QKV + "_scale_inv"] = torch.zeros(12)[:6].view(3, 2)
    parameters[O_PROJ + "_scale_inv"] = scales
    ElasticRefit(_config(), layouts, parameters=parameters, formats=FORMATS)  # a good set is accepted
    shared = torch.zeros(6)
    parameters[QKV + "_scale_inv"], parameters[O_PROJ + "_scale_inv"] = shared.view(3, 2), shared.view(2, 3)
    with pytest.raises(ValueError, match="share memory: each buffer needs its own"):
        ElasticRefit(_config(), layouts, parameters=parameters, formats=FORMATS)
    with pytest.raises(ValueError, match="inference rank 'i0': format fp8-block128 declared for tensor 'nope', "
                                         "which the layout lacks"):
        ElasticRefit(_config(), layouts, parameters=_parameters(),
                     formats=TensorFormats.from_mapping({**FORMATS.as_dict(), "nope": "fp8"}))
    with pytest.raises(ValueError, match="trainer 't0': formats are declared by inference ranks"):
        ElasticRefit(RefitConfig(job="job", role="trainer", member_id="t0", layout_rank=0, etcd=("127.0.0.1:2379",)),
                     layouts, formats=FORMATS)
