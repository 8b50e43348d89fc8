"""Fused pack + quantize on CUDA (Triton, hardware and software E4M3 casts) vs the CPU
reference quantizer, byte for byte, and the unpack into FP8 weights and scales
(auto-skipped without a GPU). Run: ``python -m pytest -m gpu tests/gpu/test_quantize_gpu.py``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from elastic_refit.kernels.quant_program import QuantPackProgram, QuantRegion, QuantUnpackProgram
from elastic_refit.kernels.quantize import NonFiniteBlockError, quantize_reference, scale_shape

from elastic_refit.layout.formats import FP8_BLOCK128, MXFP8, DestinationFormat

pytestmark = pytest.mark.gpu
DEV = "cuda"
FORMATS = [FP8_BLOCK128, MXFP8, DestinationFormat("fp8-block32")]


def sync() -> None:
    if torch.device(DEV).type == "cuda":
        torch.cuda.synchronize()


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def weights(shape, seed: int) -> torch.Tensor:
    """BF16 on the CPU: a wide exponent range, an all-zero block, subnormals, signed zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-30, 30, shape, generator=g).float())
    x = x.to(torch.bfloat16)
    x[..., :128, :128] = 0
    flat = x.view(-1)
    idx = torch.randint(0, flat.numel(), (max(flat.numel() // 97, 1),), generator=g)
    flat[idx] = torch.tensor([1e-39, -1e-39, -0.0, 2.0**-126])[torch.arange(idx.numel()) % 4].to(torch.bfloat16)
    return x


def every_bf16() -> torch.Tensor:
    """Every finite BF16 value once, as a [512, 128] tensor (its blocks span all exponents)."""
    v = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    v = v[torch.isfinite(v.float())]
    out = torch.zeros(512 * 128, dtype=torch.bfloat16)
    out[: v.numel()] = v
    return out.reshape(512, 128)


def aligned_regions(shapes, fmt, rng: np.random.Generator, count: int, misalign: bool):
    """Random block-aligned boxes (edges included) at scattered bucket offsets."""
    br, bc = fmt.block_shape
    isz = 4 if fmt.kind == "fp8-block" else 1
    regions, at = [], 0
    for _ in range(count):
        t = int(rng.integers(len(shapes)))
        offs, lens = [], []
        for d, size in enumerate(shapes[t]):
            b = (br, bc)[d - len(shapes[t]) + 2] if d >= len(shapes[t]) - 2 else 1
            start = int(rng.integers(0, -(-size // b))) * b
            end = min(start + int(rng.integers(1, -(-(size - start) // b) + 1)) * b, size)
            offs.append(start)
            lens.append(end - start)
        at += int(rng.integers(0, 2)) * (1 if misalign else 16)
        p_off = at
        at += math.prod(lens)
        at += (-at) % 16
        s_off = at
        at += math.prod((*lens[:-2], -(-lens[-2] // br), -(-lens[-1] // bc))) * isz
        regions.append(QuantRegion(t, tuple(offs), tuple(lens), p_off, s_off))
    return regions


def reference_bucket(tensors, regions, fmt, before: torch.Tensor) -> torch.Tensor:
    out = before.clone()
    for r in regions:
        box = tensors[r.tensor_index][tuple(slice(o, o + n) for o, n in zip(r.offsets, r.lengths, strict=True))]
        q, s = quantize_reference(box, fmt, nonfinite="propagate")
        out[r.packed_offset_bytes : r.packed_offset_bytes + q.numel()] = u8(q).reshape(-1)
        sb = u8(s).reshape(-1)
        out[r.scale_offset_bytes : r.scale_offset_bytes + sb.numel()] = sb
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("soft_cast", [False, True], ids=["hw-cast", "soft-cast"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fused_pack_quantize_matches_cpu_reference(fmt, soft_cast, seed):
    rng = np.random.default_rng(seed)
    # kv_a_proj_with_mqa-like (a partial edge block), an expert stack, ragged odd sizes.
    shapes = [(576, 2048), (3, 512, 1024), (300, 700), (512, 128)]
    cpu = [weights(s, seed * 10 + i) for i, s in enumerate(shapes[:3])] + [every_bf16()]
    cpu[2][7, 650] = float("nan") if seed % 2 else float("inf")
    regions = aligned_regions(shapes, fmt, rng, 12, misalign=seed == 1)
    end = -(-max(r.scale_offset_bytes + 65536 for r in regions) // 16) * 16
    regions.append(QuantRegion(3, (0, 0), (512, 128), end, end + 512 * 128))
    prog = QuantPackProgram(shapes, regions, fmt, device=DEV, backend="triton", soft_cast=soft_cast)
    assert prog.backend == "triton"
    before = torch.from_numpy(rng.integers(0, 256, prog.nbytes + 64, dtype=np.uint8))
    buf = before.to(DEV)
    prog.pack([t.to(DEV) for t in cpu], buf)
    sync()
    want = reference_bucket(cpu, regions, fmt, before)
    got = buf.cpu()
    bad = torch.nonzero(got != want).flatten()
    assert bad.numel() == 0, f"{bad.numel()} bytes differ, first at {bad[:8].tolist()}"


@pytest.mark.parametrize("fmt", FORMATS[:2], ids=str)
def test_unpack_places_weights_and_scales(fmt):
    shapes = [(576, 2048), (4, 256, 512)]
    cpu = [weights(s, i) for i, s in enumerate(shapes)]
    br, bc = fmt.block_shape
    # Two disjoint boxes per tensor, as two destination shards' halves would arrive.
    regions, at = [], 0
    isz = 4 if fmt.kind == "fp8-block" else 1
    for t, shape in enumerate(shapes):
        half = (shape[-2] // 2 // br) * br
        for r0, n in ((0, half), (half, shape[-2] - half)):
            offs = (*(0,) * (len(shape) - 2), r0, 0)
            lens = (*shape[:-2], n, shape[-1])
            blocks = math.prod((*shape[:-2], -(-n // br), -(-shape[-1] // bc)))
            regions.append(QuantRegion(t, offs, lens, at, at + math.prod(lens)))
            at += math.prod(lens) + blocks * isz
            at += (-at) % 16
    pack = QuantPackProgram(shapes, regions, fmt, device=DEV, backend="triton")
    buf = torch.empty(pack.nbytes, dtype=torch.uint8, device=DEV)
    pack.pack([t.to(DEV) for t in cpu], buf)
    scale_dtype = torch.float32 if fmt.kind == "fp8-block" else torch.uint8
    w = [torch.empty(s, dtype=torch.float8_e4m3fn, device=DEV) for s in shapes]
    sc = [torch.empty(scale_shape(s, fmt), dtype=scale_dtype, device=DEV) for s in shapes]
    unpack = QuantUnpackProgram(shapes, [x.shape for x in sc], regions, fmt, device=DEV, backend="triton")
    unpack.unpack(buf, w, sc)
    sync()
    for t, x in enumerate(cpu):
        q, s = quantize_reference(x, fmt)
        assert torch.equal(u8(w[t].cpu()), u8(q)) and torch.equal(u8(sc[t].cpu()), u8(s))


def test_check_raises_for_a_poisoned_block_on_the_gpu():
    x = weights((256, 512), 3).to(DEV)
    x[130, 400] = float("nan")
    prog = QuantPackProgram([x.shape], [QuantRegion(0, (0, 0), (256, 512), 0, 131072)], FP8_BLOCK128,
                            device=DEV, names=["model.layers.7.self_attn.o_proj.weight"])
    buf = torch.empty(prog.nbytes, dtype=torch.uint8, device=DEV)
    prog.pack([x], buf)
    with pytest.raises(NonFiniteBlockError, match=r"o_proj.weight': block \[1, 3\]"):
        prog.check(buf)


@pytest.mark.parametrize("chunk_rows", [32, 64, 128])
@pytest.mark.parametrize("num_warps", [4, 8, 16])
def test_tuning_knobs_do_not_change_bytes(chunk_rows, num_warps):
    shapes = [(2, 640, 1024), (576, 2048)]
    cpu = [weights(s, 20 + i) for i, s in enumerate(shapes)]
    regions = [QuantRegion(0, (0, 128, 0), (2, 512, 1024), 0, 2 * 512 * 1024),
               QuantRegion(1, (0, 0), (576, 2048), 2 * 512 * 1024 + 4096, 2 * 512 * 1024 + 4096 + 576 * 2048)]
    prog = QuantPackProgram(shapes, regions, FP8_BLOCK128, device=DEV, backend="triton",
                            num_warps=num_warps, chunk_rows=chunk_rows)
    buf = torch.zeros(prog.nbytes, dtype=torch.uint8, device=DEV)
    prog.pack([t.to(DEV) for t in cpu], buf)
    sync()
    assert torch.equal(buf.cpu(), reference_bucket(cpu, regions, FP8_BLOCK128, torch.zeros(prog.nbytes, dtype=torch.uint8)))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_torch_reference_on_cuda_matches_cpu(fmt, seed):
    """The plain-torch quantizer run on the GPU (what a sender of a quantized plan runs, in
    slabs once a box is large) gives the CPU reference's bytes and scales, every BF16 value
    among them; in particular the scale is an IEEE quotient on CUDA too (torch multiplies by
    a rounded reciprocal when the divisor is a Python scalar)."""
    import elastic_refit.kernels.quantize as quantize

    x = torch.cat([every_bf16(), weights((1536, 128), seed)], dim=0)
    want_q, want_s = quantize_reference(x, fmt, nonfinite="propagate")
    got_q, got_s = quantize_reference(x.to(DEV), fmt, nonfinite="propagate")
    sync()
    assert torch.equal(u8(got_s).cpu(), u8(want_s)), "scales differ"
    assert torch.equal(u8(got_q).cpu(), u8(want_q)), "bytes differ"
    saved = dict(quantize._SLAB_ELEMENTS)
    try:  # the same in slabs
        quantize._SLAB_ELEMENTS.update(cuda=x.numel() // 5)
        q, s = quantize_reference(x.to(DEV), fmt, nonfinite="propagate")
        sync()
        assert torch.equal(u8(q).cpu(), u8(want_q)) and torch.equal(u8(s).cpu(), u8(want_s))
    finally:
        quantize._SLAB_ELEMENTS.update(saved)
