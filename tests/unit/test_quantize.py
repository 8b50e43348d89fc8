"""Block quantization: the reference quantizer, split blocks, and the pack/unpack programs.

The reference is checked against the definition (error bounds, zero/edge/non-finite blocks,
flushed subnormals), split blocks against whole-block quantization bit for bit, and the
programs (torch backend always; Triton through its CPU interpreter when installed) against
the reference byte for byte, including the bytes they must leave alone.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from elastic_refit.kernels import _triton_backend as tb
from elastic_refit.kernels.quant_program import QuantPackProgram, QuantRegion, QuantUnpackProgram
from elastic_refit.kernels.quantize import (
    E4M3_NAN,
    BlockScheme,
    NonFiniteBlockError,
    block_amax,
    check_scales,
    combine_amax,
    dequantize_reference,
    e4m3_bits_reference,
    quantize_reference,
    quantize_with_scales,
    scale_shape,
    scales_from_amax,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_refit.layout.formats import FP8_BLOCK128, MXFP8, DestinationFormat

FP8_16 = DestinationFormat("fp8-block16")  # small blocks: many blocks, edges and cuts per example
FORMATS = [FP8_16, MXFP8, FP8_BLOCK128]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
needs_triton = pytest.mark.skipif(not tb.HAVE_TRITON, reason="triton not installed")


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def weights(shape, seed: int, *, zero_block: bool = False, specials: bool = False) -> torch.Tensor:
    """Random BF16 with a wide exponent range; optionally an all-zero 16x16 corner and a
    sprinkling of subnormals and signed zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
    x = x.to(torch.bfloat16)
    if zero_block:
        x[..., :16, :16] = 0
    if specials:
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (max(flat.numel() // 50, 1),), generator=g)
        flat[idx] = torch.tensor([1e-39, -1e-39, -0.0, 0.0])[torch.arange(idx.numel()) % 4].to(torch.bfloat16)
    return x


# -- the E4M3 cast -----------------------------------------------------------------------------
def test_software_e4m3_cast_matches_torch_on_every_bf16_and_random_fp32():
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    every = every[torch.isfinite(every)].clamp(-448, 448)
    g = torch.Generator().manual_seed(1)
    wide = (torch.rand(1 << 18, generator=g) * 896 - 448)
    tiny = (torch.rand(1 << 18, generator=g) - 0.5) * 2**-5  # E4M3 subnormals and ties
    for y in (every, wide, tiny):
        assert torch.equal(e4m3_bits_reference(y), u8(y.to(torch.float8_e4m3fn)))


# -- the reference quantizer ---------------------------------------------------------------------
@SETTINGS
@given(
    fmt=st.sampled_from(FORMATS[:2]),
    lead=st.sampled_from([(), (2,)]),
    rows=st.integers(1, 70),
    cols=st.integers(1, 100),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_is_within_half_an_e4m3_step(fmt, lead, rows, cols, seed):
    x = weights((*lead, rows, cols), seed)
    q, s = quantize_reference(x, fmt)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == tuple(x.shape)
    assert tuple(s.shape) == scale_shape(x.shape, fmt) == fmt.scale_shape(x.shape)
    xf = x.float()
    back = dequantize_reference(q, s, fmt)
    per = dequantize_reference(torch.ones_like(q.float()).to(torch.float8_e4m3fn), s, fmt)
    y = xf / per  # the value E4M3 had to represent
    # Half a step of E4M3 (3 mantissa bits; subnormal step 2**-9), plus MX's clamping at 448.
    bound = torch.maximum(y.abs() * 2**-4, torch.full_like(y, 2**-10)) + (y.abs() - 448).clamp_min(0)
    assert torch.all((back - xf).abs() <= bound * per * (1 + 1e-6))
    if fmt.kind == "fp8-block":
        # scale_inv = amax / 448, so each block's largest element maps to +-448.
        amax = block_amax(x, fmt)
        assert torch.equal(s, torch.where(amax == 0, 1.0, torch.clamp_min(amax / 448, 2.0**-126)))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_zero_blocks_get_scale_one_and_signed_zero_bytes(fmt):
    x = torch.zeros(130, 140, dtype=torch.bfloat16)
    x[1::2] = -0.0
    q, s = quantize_reference(x, fmt)
    one = torch.ones(()) if fmt.kind == "fp8-block" else torch.tensor(127, dtype=torch.uint8)
    assert torch.all(s == one)
    assert torch.all(u8(q)[0::2] == 0) and torch.all(u8(q)[1::2] == 0x80)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_subnormal_inputs_count_as_signed_zeros(fmt):
    x = weights((64, 96), 3, specials=True)
    flushed = x.clone()
    tiny = flushed.float().abs() < 2.0**-126
    flushed[tiny] = torch.where(torch.signbit(flushed[tiny].float()), -0.0, 0.0).to(torch.bfloat16)
    a, b = quantize_reference(x, fmt), quantize_reference(flushed, fmt)
    assert torch.equal(u8(a[0]), u8(b[0])) and torch.equal(u8(a[1]), u8(b[1]))
    # A block of nothing but subnormals is a zero block.
    only = torch.full((32, 32), 1e-39, dtype=torch.bfloat16)
    assert torch.all(u8(quantize_reference(only, fmt)[0]) == 0)


def test_tiny_blocks_floor_the_scale_at_the_smallest_normal():
    x = torch.full((16, 16), 2.0**-125, dtype=torch.bfloat16)  # amax / 448 would be subnormal
    q, s = quantize_reference(x, FP8_16)
    assert torch.all(s == 2.0**-126) and torch.all(q.float() == 2.0)


def test_mx_scales_are_the_ocp_shared_exponent():
    x = torch.zeros(1, 96, dtype=torch.bfloat16)
    x[0, 0], x[0, 33], x[0, 70] = 1.0, -3.5, 448.0
    q, s = quantize_reference(x, MXFP8)
    # floor(log2(amax)) - 8, biased by 127: 1 -> 2**-8, 3.5 -> 2**-7, 448 -> 2**0.
    assert s.tolist() == [[119, 120, 127]]
    assert q.float()[0, [0, 33, 70]].tolist() == [256.0, -448.0, 448.0]


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_blocks_raise_or_propagate_poisoned(fmt, bad):
    x = weights((140, 150), 5)
    x[131, 137] = bad
    with pytest.raises(NonFiniteBlockError) as err:
        quantize_reference(x, fmt, name="model.layers.0.mlp.up_proj.weight")
    br, bc = fmt.block_shape
    block = [131 // br, 137 // bc]
    assert err.value.tensor == "model.layers.0.mlp.up_proj.weight" and list(err.value.block) == block
    assert "model.layers.0.mlp.up_proj.weight" in str(err.value) and str(block) in str(err.value)
    q, s = quantize_reference(x, fmt, nonfinite="propagate")
    poisoned = torch.isnan(s) if fmt.kind == "fp8-block" else s == 255
    assert poisoned.nonzero().tolist() == [block]
    rows, cols = slice(block[0] * br, (block[0] + 1) * br), slice(block[1] * bc, (block[1] + 1) * bc)
    assert torch.all(u8(q)[rows, cols] == E4M3_NAN)
    clean = x.clone()
    clean[rows, cols] = 0
    mask = torch.ones_like(u8(q), dtype=torch.bool)
    mask[rows, cols] = False
    assert torch.equal(u8(q)[mask], u8(quantize_reference(clean, fmt)[0])[mask])
    with pytest.raises(NonFiniteBlockError):
        check_scales(s, fmt, "w")


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="needs >= 2 dims"):
        quantize_reference(torch.zeros(8, dtype=torch.bfloat16), FP8_BLOCK128, name="norm")
    with pytest.raises(ValueError, match="not a quantized"):
        quantize_reference(torch.zeros(8, 8), DestinationFormat("bf16"))
    with pytest.raises(ValueError, match="1 x 32"):
        BlockScheme("mxfp8", (1, 16))
    with pytest.raises(ValueError, match="origin"):
        block_amax(torch.zeros(4, 4), FP8_16, origin=(16, 0))
    with pytest.raises(ValueError, match="scales must be"):
        quantize_with_scales(torch.zeros(4, 4), torch.ones(2, 2), FP8_16)


# -- split blocks --------------------------------------------------------------------------------
def cuts(draw, size: int, max_cuts: int) -> list[int]:
    inner = sorted(set(draw(st.lists(st.integers(1, max(size - 1, 1)), max_size=max_cuts))))
    return [0, *[c for c in inner if 0 < c < size], size]


@SETTINGS
@given(data=st.data(), fmt=st.sampled_from([FP8_16, MXFP8, FP8_BLOCK128]), poison=st.booleans())
def test_split_blocks_combine_to_the_whole_block_quantization(data, fmt, poison):
    """Shards cut blocks anywhere (TP boundaries that are not multiples of the block): each
    holder's partial amax, combined by max, then its own sub-box quantized with the combined
    scales, gives the whole tensor's quantization bit for bit."""
    big = fmt.block_shape[0] == 128
    rows = data.draw(st.integers(1, 300 if big else 70))
    cols = data.draw(st.integers(1, 300 if big else 100))
    x = weights((rows, cols), data.draw(st.integers(0, 2**31 - 1)), zero_block=True)
    if poison:
        x[data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, cols - 1))] = float("nan")
    want_q, want_s = quantize_reference(x, fmt, nonfinite="propagate")
    br, bc = fmt.block_shape
    row_cuts, col_cuts = cuts(data.draw, rows, 3), cuts(data.draw, cols, 3)
    subs = [(r0, r1, c0, c1) for r0, r1 in itertools.pairwise(row_cuts) for c0, c1 in itertools.pairwise(col_cuts)]
    # Each holder: partial amax of its sub-box, placed on the global block grid.
    partials = []
    for r0, r1, c0, c1 in subs:
        part = block_amax(x[r0:r1, c0:c1], fmt, origin=(r0 % br, c0 % bc))
        grid = torch.zeros(want_s.shape)
        grid[r0 // br : r0 // br + part.shape[0], c0 // bc : c0 // bc + part.shape[1]] = part
        partials.append(grid)
    scales = scales_from_amax(combine_amax(*partials), fmt)
    assert torch.equal(u8(scales), u8(want_s))
    got = torch.empty_like(u8(want_q))
    for r0, r1, c0, c1 in subs:
        mine = scales[r0 // br : -(-r1 // br), c0 // bc : -(-c1 // bc)]
        got[r0:r1, c0:c1] = u8(quantize_with_scales(x[r0:r1, c0:c1], mine, fmt, origin=(r0 % br, c0 % bc)))
    assert torch.equal(got, u8(want_q))


def assert_slabs_match_whole(x, fmt, origin, slab):
    """``x`` reduced and quantized in slabs of at most ``slab`` elements equals one piece."""
    import elastic_refit.kernels.quantize as quantize

    whole_amax = block_amax(x, fmt, origin)
    scales = scales_from_amax(whole_amax, fmt)
    whole_q = quantize_with_scales(x, scales, fmt, origin)
    saved = dict(quantize._SLAB_ELEMENTS)
    try:
        quantize._SLAB_ELEMENTS.update(cpu=slab)
        assert torch.equal(u8(block_amax(x, fmt, origin)), u8(whole_amax))
        assert torch.equal(u8(quantize_with_scales(x, scales, fmt, origin)), u8(whole_q))
    finally:
        quantize._SLAB_ELEMENTS.update(saved)


@SETTINGS
@given(data=st.data(), fmt=st.sampled_from([FP8_16, MXFP8]), poison=st.booleans())
def test_large_boxes_quantize_in_slabs_bit_for_bit(data, fmt, poison):
    """Boxes over the slab size are reduced and quantized in slabs of whole block rows (and
    runs of leading dims): the same amax, scales and bytes as in one piece, at any origin."""
    br, bc = fmt.block_shape
    lead = tuple(data.draw(st.sampled_from([(), (3,), (2, 2)])))
    shape = (*lead, data.draw(st.integers(1, 70)), data.draw(st.integers(1, 70)))
    origin = (data.draw(st.integers(0, br - 1)), data.draw(st.integers(0, bc - 1)))
    x = weights(shape, data.draw(st.integers(0, 2**31 - 1)))
    if poison:
        x.view(-1)[data.draw(st.integers(0, x.numel() - 1))] = float("inf")
    assert_slabs_match_whole(x, fmt, origin, data.draw(st.integers(1, max(1, x.numel() - 1))))


@pytest.mark.parametrize(("shape", "origin", "slab"), [
    ((70, 5), (5, 3), 2 * 16 * 5),  # slabs of two block rows, the first cut short by the origin
    ((3, 40, 9), (15, 0), 9),  # one expert at a time, then single block rows
    ((2, 2, 33, 20), (1, 7), 33 * 20 * 3),  # runs of the leading dims
])
def test_slab_cuts_of_known_boxes(shape, origin, slab):
    assert_slabs_match_whole(weights(shape, 7), FP8_16, origin, slab)


# -- pack and unpack programs ----------------------------------------------------------------
def aligned_box(draw, shape, block):
    """A box of ``shape`` on block boundaries (ending on one or at the edge)."""
    offs, lens = [], []
    for d, size in enumerate(shape):
        b = block[d - len(shape) + 2] if d >= len(shape) - 2 else 1
        starts = list(range(0, size, b))
        start = draw(st.sampled_from(starts))
        ends = [e for e in range(start + b, size + b, b)]
        end = min(draw(st.sampled_from(ends)), size)
        offs.append(start)
        lens.append(end - start)
    return tuple(offs), tuple(lens)


def random_layout(data, fmt, max_side: int):
    """Tensors, block-aligned regions at scattered bucket offsets (gaps hold sentinels)."""
    br, bc = fmt.block_shape
    shapes = [
        tuple(data.draw(st.sampled_from([(), (2,), (3,)]))) + (data.draw(st.integers(1, max_side)),
                                                             data.draw(st.integers(1, max_side)))
        for _ in range(data.draw(st.integers(1, 3)))
    ]
    regions, at = [], 0
    isz = 4 if fmt.kind == "fp8-block" else 1
    for _ in range(data.draw(st.integers(1, 4))):
        t = data.draw(st.integers(0, len(shapes) - 1))
        offs, lens = aligned_box(data.draw, shapes[t], (br, bc))
        numel = math.prod(lens)
        blocks = math.prod((*lens[:-2], -(-lens[-2] // br), -(-lens[-1] // bc)))
        at += data.draw(st.sampled_from([0, 1, 16]))
        p_off = at
        at += numel
        at += (-at) % isz + data.draw(st.sampled_from([0, isz]))
        regions.append(QuantRegion(t, offs, lens, p_off, at))
        at += blocks * isz
    return shapes, regions


def expected_bucket(shapes, tensors, regions, fmt, before: torch.Tensor) -> torch.Tensor:
    out = before.clone()
    for r in regions:
        box = tensors[r.tensor_index][tuple(slice(o, o + n) for o, n in zip(r.offsets, r.lengths, strict=True))]
        q, s = quantize_reference(box, fmt, nonfinite="propagate")
        out[r.packed_offset_bytes : r.packed_offset_bytes + q.numel()] = u8(q).reshape(-1)
        sb = u8(s).reshape(-1)
        out[r.scale_offset_bytes : r.scale_offset_bytes + sb.numel()] = sb
    return out


@SETTINGS
@given(data=st.data(), fmt=st.sampled_from([FP8_16, MXFP8]))
def test_torch_pack_and_unpack_match_the_reference(data, fmt):
    shapes, regions = random_layout(data, fmt, 70)
    tensors = [weights(s, i, zero_block=True, specials=True) for i, s in enumerate(shapes)]
    if data.draw(st.booleans()):
        tensors[0].view(-1)[data.draw(st.integers(0, tensors[0].numel() - 1))] = float("inf")
    prog = QuantPackProgram(shapes, regions, fmt, backend="torch")
    g = np.random.default_rng(0)
    before = torch.from_numpy(g.integers(0, 256, prog.nbytes + 8, dtype=np.uint8))
    buf = before.clone()
    prog.pack(tensors, buf)
    assert torch.equal(buf, expected_bucket(shapes, tensors, regions, fmt, before))
    # Unpack into destination tensors: exactly the regions' boxes and block boxes change.
    scale_dtype = torch.float32 if fmt.kind == "fp8-block" else torch.uint8
    scale_shapes = [scale_shape(s, fmt) for s in shapes]
    w = [torch.from_numpy(g.integers(0, 256, s, dtype=np.uint8)).view(torch.float8_e4m3fn) for s in shapes]
    sc = [torch.from_numpy(g.integers(0, 256, (*s[:-1], s[-1] * (4 if fmt.kind == "fp8-block" else 1)),
                                      dtype=np.uint8)).view(scale_dtype) for s in scale_shapes]
    want_w, want_s = [u8(t).clone() for t in w], [u8(t).clone() for t in sc]
    br, bc = fmt.block_shape
    for r in regions:
        box = tuple(slice(o, o + n) for o, n in zip(r.offsets, r.lengths, strict=True))
        q, s = quantize_reference(tensors[r.tensor_index][box], fmt, nonfinite="propagate")
        want_w[r.tensor_index][box] = u8(q)
        bbox = (*box[:-2], slice(r.offsets[-2] // br, r.offsets[-2] // br + s.shape[-2]),
                slice(r.offsets[-1] // bc, r.offsets[-1] // bc + s.shape[-1]))
        want_s[r.tensor_index].view(scale_dtype)[bbox] = s
    overlapping = any(
        a.tensor_index == b.tensor_index and all(
            oa < ob + lb and ob < oa + la for oa, la, ob, lb in zip(a.offsets, a.lengths, b.offsets, b.lengths, strict=True))
        for i, a in enumerate(regions) for b in regions[i + 1:]
    )
    up = QuantUnpackProgram(shapes, scale_shapes, regions, fmt, backend="torch")
    if overlapping:
        with pytest.raises(ValueError, match="overlap"):
            up.unpack(buf, w, sc)
        return
    up.unpack(buf, w, sc)
    for got, want in zip(w + sc, want_w + want_s, strict=True):
        assert torch.equal(u8(got), want)


def test_program_check_names_tensor_and_block():
    x = weights((256, 384), 9)
    x[200, 300] = float("nan")
    regions = [QuantRegion(0, (128, 128), (128, 256), 0, 32768)]
    prog = QuantPackProgram([x.shape], regions, FP8_BLOCK128, backend="torch", names=["model.layers.3.mlp.down_proj.weight"])
    buf = torch.zeros(prog.nbytes, dtype=torch.uint8)
    prog.pack([x], buf)
    with pytest.raises(NonFiniteBlockError, match=r"down_proj.weight': block \[1, 2\]"):
        prog.check(buf)


def test_program_validation():
    with pytest.raises(ValueError, match="out of bounds"):
        QuantPackProgram([(16, 16)], [QuantRegion(0, (0, 0), (17, 16), 0, 1024)], FP8_16)
    with pytest.raises(ValueError, match="overlap"):
        QuantPackProgram([(16, 16)], [QuantRegion(0, (0, 0), (16, 16), 0, 8)], FP8_16)
    with pytest.raises(ValueError, match="multiple of the scale size"):
        QuantPackProgram([(16, 16)], [QuantRegion(0, (0, 0), (16, 16), 0, 258)], FP8_16)
    with pytest.raises(ValueError, match="whole 16x16 blocks"):
        QuantUnpackProgram([(32, 32)], [(2, 2)], [QuantRegion(0, (8, 0), (8, 32), 0, 256)], FP8_16)
    with pytest.raises(ValueError, match="block grid"):
        QuantUnpackProgram([(32, 32)], [(2, 3)], [], FP8_16)
    with pytest.raises(ValueError, match="rank >= 2"):
        QuantRegion(0, (0,), (4,), 0, 0)


# -- the Triton kernel, interpreted on the CPU --------------------------------------------------
@needs_triton
@pytest.mark.parametrize(
    ("fmt", "shapes", "regions"),
    [
        # Whole tiles (EVEN), a ragged edge, a 3-D expert stack with a partial edge block.
        (FP8_BLOCK128, [(256, 384), (2, 200, 136)],
         [QuantRegion(0, (0, 128), (256, 256), 0, 200000), QuantRegion(1, (0, 128, 0), (2, 72, 136), 70000, 200032)]),
        (FP8_16, [(70, 90), (3, 64, 64)],
         [QuantRegion(0, (16, 0), (54, 90), 1, 20000), QuantRegion(1, (1, 0, 0), (2, 64, 64), 8000, 21000)]),
        (MXFP8, [(40, 300), (2, 32, 128)],
         [QuantRegion(0, (0, 32), (40, 268), 0, 20000), QuantRegion(1, (0, 0, 0), (2, 32, 128), 11000, 21000)]),
    ],
    ids=["fp8-block128", "fp8-block16", "mxfp8"],
)
def test_triton_interpreted_matches_reference(fmt, shapes, regions):
    """The kernel's own code, run by Triton's interpreter, with the software E4M3 cast: the
    interpreter's float8 conversion is inexact (subnormals; mantissa carries such as
    7.78 -> 8.0), so the hardware cast is checked on the GPU (tests/gpu)."""
    tensors = [weights(s, i, zero_block=True, specials=True) for i, s in enumerate(shapes)]
    tensors[1].view(-1)[77] = float("nan")
    prog = QuantPackProgram(shapes, regions, fmt, backend="triton")
    g = np.random.default_rng(1)
    before = torch.from_numpy(g.integers(0, 256, prog.nbytes + 16, dtype=np.uint8))
    buf = before.clone()
    prog.pack(tensors, buf)
    assert torch.equal(buf, expected_bucket(shapes, tensors, regions, fmt, before))
    assert prog.num_launches >= 1


@needs_triton
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), fmt=st.sampled_from([FP8_16, MXFP8]))
def test_triton_interpreted_matches_reference_on_random_buckets(data, fmt):
    shapes, regions = random_layout(data, fmt, 48)
    tensors = [weights(s, i + 7, zero_block=True, specials=True) for i, s in enumerate(shapes)]
    if data.draw(st.booleans()):
        tensors[-1].view(-1)[data.draw(st.integers(0, tensors[-1].numel() - 1))] = -float("inf")
    prog = QuantPackProgram(shapes, regions, fmt, backend="triton")
    before = torch.from_numpy(np.random.default_rng(2).integers(0, 256, prog.nbytes + 8, dtype=np.uint8))
    buf = before.clone()
    prog.pack(tensors, buf)
    assert torch.equal(buf, expected_bucket(shapes, tensors, regions, fmt, before))


@needs_triton
@pytest.mark.parametrize("chunk_rows", [32, 64, 128])
def test_triton_interpreted_rows_per_pass_do_not_change_bytes(chunk_rows):
    shapes = [(256, 200)]
    regions = [QuantRegion(0, (0, 0), (256, 200), 0, 60000)]
    x = [weights(shapes[0], 11, zero_block=True, specials=True)]
    x[0][140, 150] = float("nan")
    prog = QuantPackProgram(shapes, regions, FP8_BLOCK128, backend="triton", chunk_rows=chunk_rows)
    assert prog.tiles == (128, 128, chunk_rows)
    buf = torch.zeros(prog.nbytes, dtype=torch.uint8)
    prog.pack(x, buf)
    assert torch.equal(buf, expected_bucket(shapes, x, regions, FP8_BLOCK128, torch.zeros_like(buf)))


def test_chunk_rows_validation():
    with pytest.raises(ValueError, match="chunk_rows"):
        QuantPackProgram([(16, 16)], [], FP8_BLOCK128, chunk_rows=48)
    with pytest.raises(ValueError, match="chunk_rows"):
        QuantPackProgram([(16, 16)], [], MXFP8, chunk_rows=16)


def _strided_case(fmt):
    """Two boxes of a [2, 48, 80] BF16 tensor quantized in place into a bucket that holds
    an FP8 tensor of the same shape and its scale grid (as the executor's staging arena
    does): the second box starts one block row down and one block column across."""
    br, bc = fmt.block_shape
    shape = (2, 48, 80)
    grid = (2, -(-48 // br), -(-80 // bc))
    isz = 4 if fmt.kind == "fp8-block" else 1
    d_str, s_str = (48 * 80, 80, 1), (grid[1] * grid[2], grid[2], 1)
    s_base = 2 * 48 * 80
    boxes = [((0, 0, 0), (1, 48, 80)), ((1, br, bc), (1, 48 - br, 80 - bc))]
    regions = [QuantRegion(0, o, n, sum(a * s for a, s in zip(o, d_str, strict=True)),
                           s_base + isz * (o[0] * s_str[0] + o[1] // br * s_str[1] + o[2] // bc),
                           data_strides=d_str, scale_strides=s_str) for o, n in boxes]
    return shape, grid, boxes, regions, s_base


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("fmt", [FP8_16, MXFP8], ids=["fp8-block16", "mxfp8"])
def test_strided_regions_write_boxes_of_a_tensor_and_its_scales(backend, fmt):
    shape, grid, boxes, regions, s_base = _strided_case(fmt)
    x = weights(shape, 5, zero_block=True, specials=True)
    prog = QuantPackProgram([shape], regions, fmt, backend=backend)
    fill = torch.from_numpy(np.random.default_rng(3).integers(0, 256, prog.nbytes, dtype=np.uint8))
    buf = fill.clone()
    prog.pack([x], buf)
    sch = BlockScheme(fmt.kind, fmt.block_shape)
    q_all = buf[:s_base].view(torch.float8_e4m3fn).reshape(shape)
    s_all = buf[s_base:].view(sch.scale_dtype)[: math.prod(grid)].reshape(grid)
    want_q = fill[:s_base].clone().reshape(shape)
    for offsets, lengths in boxes:
        box = tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
        q, s = quantize_reference(x[box], fmt, nonfinite="propagate")
        assert torch.equal(u8(q_all[box]), u8(q))
        br, bc = fmt.block_shape
        s_box = (box[0], slice(offsets[1] // br, None), slice(offsets[2] // bc, None))
        assert torch.equal(s_all[s_box].contiguous().view(torch.uint8), s.contiguous().view(torch.uint8))
        want_q[box] = u8(q)
    # nothing else of the FP8 tensor is touched (box 1 leaves its first block row and column)
    assert torch.equal(buf[:s_base].reshape(shape), want_q)
    assert prog.nbytes == s_base + (math.prod(grid)) * sch.scale_itemsize


def test_strided_region_validation():
    with pytest.raises(ValueError, match="data_strides"):
        QuantRegion(0, (0, 0), (4, 8), 0, 0, data_strides=(8, 2))
    with pytest.raises(ValueError, match="overlap"):
        QuantRegion(0, (0, 0), (4, 8), 0, 0, data_strides=(4, 1))
    with pytest.raises(ValueError, match="scale_strides"):
        QuantRegion(0, (0, 0), (4, 8), 0, 0, scale_strides=(1,))
    with pytest.raises(ValueError, match="strided regions are for packing"):
        QuantUnpackProgram([(16, 16)], [(1, 1)], [QuantRegion(0, (0, 0), (16, 16), 0, 256, data_strides=(16, 1))],
                           FP8_16)


@needs_triton
@pytest.mark.parametrize("shape", [(256, 256), (200, 384), (130, 200)], ids=["even", "ragged-rows", "ragged-both"])
def test_triton_interpreted_multi_pass_path_matches_reference(shape):
    """The 128-row multi-pass path (block amax and poison from integer magnitude bits):
    whole tiles, a row mask only, and a full mask; a NaN block and an all-zero one."""
    regions = [QuantRegion(0, (0, 0), shape, 0, shape[0] * shape[1])]
    x = [weights(shape, 13, zero_block=True, specials=True)]
    x[0][shape[0] - 1, 5] = float("nan")
    prog = QuantPackProgram([shape], regions, FP8_BLOCK128, backend="triton", chunk_rows=32)
    buf = torch.zeros(prog.nbytes, dtype=torch.uint8)
    prog.pack(x, buf)
    assert torch.equal(buf, expected_bucket([shape], x, regions, FP8_BLOCK128, torch.zeros_like(buf)))
