"""`bench`'s budget (cli/bench_budget.py): the memory of every method it runs, FP8 included,
and timeouts from the work; `bench` refuses what cannot fit before it starts anything.
(The estimate against a real run's peak memory: tests/integration/test_bench_budget.py.)"""

from __future__ import annotations

import json

from elastic_refit import cli
from elastic_refit.cli.bench_budget import PROCESS_BYTES, estimate
from elastic_refit.testing.world import RefitCase

MiB = 1 << 20


def _spec(rows: int, cols: int, fmt: str | None = None) -> str:
    dst = {"mesh": [2, 3], "placements": ["S(1)"], **({"format": fmt} if fmt else {})}
    return json.dumps({"domain_size": 2, "tensors": [
        {"name": "w", "shape": [rows, cols], "dtype": "bfloat16", "source": {"mesh": [0, 1], "placements": ["S(0)"]},
         "destination": dst},
        {"name": "n", "shape": [cols], "dtype": "bfloat16", "source": {"mesh": [0, 1], "placements": ["R"]},
         "destination": {"mesh": [2, 3], "placements": ["R"]}}]})


def _budget(rows: int, cols: int, fmt: str | None = None, methods=("reshard", "gather_broadcast"), **kw):
    case = RefitCase(spec_json=_spec(rows, cols, fmt), bucket_bytes=1 * MiB)
    if fmt:
        from elastic_refit.layout import parse_spec

        case = RefitCase(spec_json=case.spec_json, bucket_bytes=case.bucket_bytes,
                         formats_json=parse_spec(json.loads(case.spec_json)).destination_formats.to_json())
    args = {"staging_bytes": 4 * MiB, "chunk_bytes": MiB, "p2p_bytes": 8 * MiB, "runs": 2, "cores": 2} | kw
    return estimate(case.plan(), case.plan_quantized(), methods=list(methods), **args)


def test_every_part_of_every_rank_is_counted():
    b = _budget(1024, 512)
    w, n = 1024 * 512 * 2, 512 * 2
    src, dst = [r.buffers for r in b.ranks[:2]], [r.buffers for r in b.ranks[2:]]
    assert src == [w // 2 + n] * 2 and dst == [w // 2 + n] * 2  # each rank's own buffers
    assert all(r.process == PROCESS_BYTES for r in b.ranks)
    # staging: buckets of at most what a rank moves (here less than the 1 MiB bucket), within budget
    assert all(0 < r.staging < 4 * MiB for r in b.ranks)
    assert all(r.staging == 4 * MiB for r in _budget(4096, 2048).ranks)  # every bucket full
    # slabs: ~64 bytes an element the rank holds, above the 8 MiB p2p message here ...
    assert [r.transient for r in b.ranks] == [64 * (1024 * 512 // 2 + 512)] * 4
    assert all(r.transient == 64 * MiB for r in _budget(1024, 512, p2p_bytes=64 * MiB).ranks)  # ... not here
    assert all(r.transient == 256 * MiB for r in _budget(4096, 2048, p2p_bytes=MiB).ranks)  # whole slabs
    # gather-and-broadcast: a destination stages the whole w (its broadcast chain) and two chunks
    assert all(r.baseline == w + 2 * MiB for r in b.ranks[2:])
    assert b.memory == sum(r.total for r in b.ranks)
    assert "buffers" in b.describe_memory() and "timeout" in b.describe_time()


def test_the_fp8_reshard_adds_its_destination_staging_and_quantized_copies():
    plain = _budget(4096, 2048, "fp8-block128", methods=("reshard", "gather_broadcast"))
    fp8 = _budget(4096, 2048, "fp8-block128", methods=("reshard", "reshard_fp8", "gather_broadcast"))
    w = 4096 * 2048
    for before, after in zip(plain.ranks[2:], fp8.ranks[2:], strict=True):  # destinations: FP8 w + scales, n
        assert after.buffers - before.buffers == w // 2 + 32 * 8 * 4 + 2048 * 2  # scales [32, 8] float32
        assert after.staging - before.staging == 4 * MiB  # the FP8 executor's own
    for before, after in zip(plain.ranks[:2], fp8.ranks[:2], strict=True):  # senders: FP8 copy + staging
        assert after.staging - before.staging == 4 * MiB + w // 2 + 16 * 16 * 4  # its 2048 rows: [16, 16] scales
    assert fp8.run_seconds["reshard_fp8"] > fp8.run_seconds["reshard"]
    assert fp8.check_seconds["reshard_fp8"] > fp8.check_seconds["reshard"]


def test_the_timeout_fits_the_work_and_never_drops_below_a_minute():
    small, large = _budget(256, 256), _budget(32768, 16384)
    assert small.timeout_s == 60.0
    worst = max(large.run_seconds[m] + large.check_seconds[m] for m in large.run_seconds)
    assert large.timeout_s >= 3 * worst > 60
    assert large.total_s > 2 * large.timeout_s
    # the same work on more cores (fewer ranks per core) may wait less, never below a minute
    assert _budget(32768, 16384, cores=64).timeout_s < large.timeout_s


def test_bench_refuses_what_cannot_fit_before_it_starts(capsys, tmp_path):
    spec = tmp_path / "huge.json"
    spec.write_text(_spec(1 << 22, 1 << 15))  # a 256 GiB tensor: planned (cheap), never allocated
    code = cli.main(["bench", "--spec", str(spec)])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("elastic-refit: error: the benchmark needs about ")
    assert "buffers " in err and "staging " in err and "baseline " in err and "is available" in err


def test_bench_help_says_the_timeout_comes_from_the_work(capsys):
    assert cli.main(["bench", "--help"]) == 0
    assert "default: from the work" in " ".join(capsys.readouterr().out.split())


def test_bench_refuses_a_spec_that_casts(capsys, tmp_path):
    spec = tmp_path / "cast.json"
    data = json.loads(_spec(64, 32))
    data["tensors"][0]["source"]["dtype"] = "float32"
    spec.write_text(json.dumps(data))
    assert cli.main(["bench", "--spec", str(spec)]) == 2
    assert "this spec casts (1 tensor(s) float32 -> bfloat16)" in capsys.readouterr().err
