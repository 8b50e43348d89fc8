"""Destination dtypes (layout.casts): a destination in BF16 fed by an FP32 source.

The pack kernel casts bit-for-bit as ``tensor.to(dtype)`` (specials, subnormals, ties,
unaligned packed offsets, both directions); the plan is the destination's bytes (the same rows
and figures as a source that already holds BF16, a fingerprint of its own); the executor's
buckets carry BF16 and every destination element lands as the FP32 source's ``.to(bf16)``.
"""

from __future__ import annotations

import json

import pytest
import torch
from elastic_refit.kernels import BoxRegion, PackProgram

from elastic_refit.layout import parse_spec
from elastic_refit.layout.casts import SourceCast, cast_layout, check_cast, source_casts
from elastic_refit.plan import make_plan, make_rank_plan, rank_slice
from elastic_refit.plan.types import PlanOptions
from elastic_refit.testing.local_transport import LocalTransport
from elastic_refit.testing.pattern import allocate, check_pieces, fill_pieces
from elastic_refit.testing.world import SENTINEL, padding_problems
from elastic_refit.transport.schedule import build_rank_schedule


def _specials(n: int, seed: int = 0) -> torch.Tensor:
    """FP32 values that exercise rounding: random bits (NaNs with payloads, infinities,
    subnormals), signed zeros and exact BF16 ties (the low 16 bits 0x8000)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32).clone()
    fixed = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-45, 65504.0, 70000.0,
                          448.0, 500.0, 3.0e38], dtype=torch.float32)
    x[: fixed.numel()] = fixed
    ties = (bits[fixed.numel(): fixed.numel() + 16] & ~0xFFFF) | 0x8000  # halfway between two BF16 values
    x[fixed.numel(): fixed.numel() + 16] = ties.view(torch.float32)
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dst", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float64])
def test_pack_casts_bit_exact_as_tensor_to(dst):
    src = _specials(12 * 40).reshape(12, 40)
    regions = [BoxRegion(0, (1, 3), (5, 17), 0), BoxRegion(0, (7, 0), (4, 40), 256 * 8)]
    program = PackProgram([src.shape], [src.dtype], regions, packed_dtypes=[dst], backend="torch")
    itemsize = torch.empty((), dtype=dst).element_size()
    assert program.nbytes == 256 * 8 + 4 * 40 * itemsize  # the packed bytes are the destination's
    out = torch.zeros(program.nbytes, dtype=torch.uint8)
    program.pack([src], out)
    first = out[: 5 * 17 * itemsize]
    second = out[256 * 8:]
    assert torch.equal(first, _bits(src[1:6, 3:20].to(dst)).reshape(-1))
    assert torch.equal(second, _bits(src[7:11].to(dst)).reshape(-1))


def test_cast_regions_at_unaligned_offsets_and_beside_byte_regions_both_ways():
    """A cast region at an odd byte offset, a plain region of another tensor beside it
    (the byte-copy path), and unpack casting back into a BF16 tensor."""
    src = _specials(6 * 10, seed=3).reshape(6, 10)
    other = torch.arange(8, dtype=torch.int16)
    regions = [BoxRegion(0, (0, 1), (6, 3), 3), BoxRegion(1, (2,), (5,), 100)]
    program = PackProgram([src.shape, other.shape], [src.dtype, other.dtype], regions,
                          packed_dtypes=[torch.bfloat16, torch.int16], backend="torch")
    out = torch.zeros(program.nbytes, dtype=torch.uint8)
    program.pack([src, other], out)
    assert torch.equal(out[3: 3 + 36], _bits(src[:, 1:4].to(torch.bfloat16)).reshape(-1))
    assert torch.equal(out[100:110], _bits(other[2:7]).reshape(-1))
    back = torch.zeros(6, 10, dtype=torch.float32)
    program.bind([back, torch.zeros_like(other)], out).unpack()
    assert torch.equal(_bits(back[:, 1:4]), _bits(src[:, 1:4].to(torch.bfloat16).to(torch.float32)))
    assert torch.equal(back[:, 4:], torch.zeros(6, 6))  # nothing outside the box is written


def test_check_cast_and_source_casts_refuse_integer_casts_naming_the_tensor():
    check_cast("w", "float32", "bfloat16")
    check_cast("w", "int8", "int8")
    with pytest.raises(ValueError, match=r"tensor 'w': source is float32, destination is int8"):
        check_cast("w", "float32", "int8")
    spec = _spec("float32", "bfloat16")
    assert source_casts(spec.source, spec.destination) == {"w": ("float32", "bfloat16"), "b": ("float32", "bfloat16")}
    assert source_casts(spec.source, spec.source) == {}
    with pytest.raises(ValueError, match="floating dtypes only"):
        make_plan(_spec("float32", "int32").source, _spec("float32", "int32").destination, spec.topology)


def test_a_buffer_cast_whole_or_not_at_all():
    spec = _spec("float32", "bfloat16")
    casted = cast_layout(spec.source, {"w": "bfloat16", "b": "bfloat16"})
    assert {b.dtype for b in casted.buffers()} == {"bfloat16"}
    assert [p for p in casted.pieces()] == [p for p in spec.source.pieces()]
    assert SourceCast.between(spec.source, spec.destination).describe() == "2 tensor(s) float32 -> bfloat16"


SPEC = {"domain_size": 2, "tensors": [
    {"name": "w", "shape": [12, 10], "source": {"mesh": [0, 1, 2], "placements": ["S(0)"]},
     "destination": {"mesh": [[3, 4], [5, 6]], "placements": ["R", "S(1)"]}},
    {"name": "b", "shape": [7], "source": {"mesh": [0, 1, 2], "placements": ["R"]},
     "destination": {"mesh": [3, 4, 5, 6], "placements": ["R"]}},
]}


def _spec(source_dtype: str, destination_dtype: str):
    data = json.loads(json.dumps(SPEC))
    for t in data["tensors"]:
        t["source"]["dtype"], t["destination"]["dtype"] = source_dtype, destination_dtype
    return parse_spec(data)


def test_the_plan_counts_the_destinations_bytes_and_fingerprints_its_cast():
    cast, plain = _spec("float32", "bfloat16"), _spec("bfloat16", "bfloat16")
    options = PlanOptions(bucket_bytes=64)
    plan = make_plan(cast.source, cast.destination, cast.topology, options)
    same = make_plan(plain.source, plain.destination, plain.topology, options)
    assert plan.cast is not None and plan.cast.logical_source is cast.source and same.cast is None
    assert plan.stats == same.stats  # every figure in BF16 bytes
    assert plan.stats.model_bytes == (12 * 10 + 7) * 2  # not the FP32 source's 508
    assert plan.stats.dst_bytes == (2 * 12 * 10 + 4 * 7) * 2  # two replicas of w, four of b
    assert plan.source.fingerprint == plain.source.fingerprint  # planned on the source in BF16
    assert plan.fingerprint != same.fingerprint
    for column, values in same.transfers.columns().items():
        assert (plan.transfers.columns()[column] == values).all(), column
    for rank in (0, 3):  # a rank's own view agrees with the full plan's, cast included
        view = make_rank_plan(cast.source, cast.destination, cast.topology, options, rank=rank)
        assert view.fingerprint == rank_slice(plan, rank).fingerprint and view.cast is not None
    schedule = build_rank_schedule(plan, 0)
    assert {r: b.dtype for r, b in schedule.buffers.items()} == {(0, "w"): "float32", (0, "b"): "float32"}
    assert schedule.wire_dtypes == {(0, "w"): "bfloat16", (0, "b"): "bfloat16"}


def test_a_plan_with_casts_and_quantized_formats_is_refused():
    from elastic_refit.layout import TensorFormats

    cast = _spec("float32", "bfloat16")
    with pytest.raises(ValueError, match="beside a dtype cast"):
        make_plan(cast.source, cast.destination, cast.topology, formats=TensorFormats.from_mapping({"w": "fp8-block16"}))


@pytest.mark.parametrize("bucket_bytes", [32, 4096])
def test_the_executor_lands_fp32_into_bf16_bit_exact(bucket_bytes):
    """Every bucket packed by its sender (cast on the way), copied, unpacked: each
    destination element is the FP32 pattern's ``.to(bfloat16)``, padding untouched."""
    spec = _spec("float32", "bfloat16")
    plan = make_plan(spec.source, spec.destination, spec.topology, PlanOptions(bucket_bytes=bucket_bytes))
    buffers = {}
    for r in sorted(set(plan.source.ranks) | set(plan.destination.ranks)):
        src = allocate(spec.source, r, fill=0)
        fill_pieces(spec.source, r, src, seed=5)
        buffers[r] = (src, allocate(plan.destination, r, fill=SENTINEL))
    runner = LocalTransport(plan, torch.device("cpu"))
    runner.run(buffers)
    assert runner.bytes_moved == plan.stats.cross_domain_bytes + plan.stats.intra_domain_bytes + plan.stats.local_bytes
    for r in plan.destination.ranks:
        dst = buffers[r][1]
        assert {t.dtype for t in dst.values()} == {torch.bfloat16}
        assert check_pieces(spec.destination, r, dst, seed=5, cast_from={"w": "float32", "b": "float32"}) == []
        assert padding_problems(plan.destination, r, dst, SENTINEL) == []


def test_a_colocated_rank_casts_its_local_copies():
    """Source and destination on one rank (colocated): the plan's local copies cast too."""
    spec = parse_spec({"domain_size": 2, "tensors": [
        {"name": "w", "shape": [9, 5], "source": {"mesh": [0, 1, 2], "placements": ["S(0)"], "dtype": "float32"},
         "destination": {"mesh": [[0, 1], [2, 3]], "placements": ["R", "S(1)"], "dtype": "bfloat16"}}]})
    plan = make_plan(spec.source, spec.destination, spec.topology, PlanOptions(bucket_bytes=32))
    assert plan.stats.local_bytes > 0 and plan.cast is not None
    buffers = {}
    for r in sorted(set(plan.source.ranks) | set(plan.destination.ranks)):
        src = allocate(spec.source, r, fill=0)
        fill_pieces(spec.source, r, src, seed=9)
        buffers[r] = (src, allocate(plan.destination, r, fill=SENTINEL))
    LocalTransport(plan, torch.device("cpu")).run(buffers)
    for r in plan.destination.ranks:
        assert check_pieces(spec.destination, r, buffers[r][1], seed=9, cast_from={"w": "float32"}) == []
