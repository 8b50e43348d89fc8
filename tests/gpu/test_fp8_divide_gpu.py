"""The fp8-block kernel's division without a division per element (``_divide`` in
kernels/_triton_quant.py) against IEEE ``div_rn``, for every pair of a BF16 block amax and a
BF16 value the block can hold (|value| <= amax): about 2.1e9 pairs, all of them, on the GPU
(auto-skipped without one). Run: ``python -m pytest -m gpu tests/gpu/test_fp8_divide_gpu.py``.

Both sides run the kernel's own ``_scales`` (the scale the checkpoint stores) and then the
same clamp and E4M3 cast; the check counts pairs whose E4M3 byte differs (signed zeros
included) and, stronger, pairs whose float32 quotient differs where ``div_rn``'s is 2**-12 or
more (below that both become a zero byte, which the byte count covers)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from elastic_refit.kernels._triton_backend import load_source  # noqa: E402

_mod = load_source("_triton_quant.py", interpret=False)
_scales = _mod._scales
_divide = _mod._divide


@triton.jit
def _pairs_kernel(amax_bits_ptr, out_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    amax = tl.load(amax_bits_ptr + pid).to(tl.float32, bitcast=True)
    amax_v = tl.full((BLOCK,), 0.0, tl.float32) + amax
    unit, rcp, pow2, stored = _scales(amax_v, tl.full((BLOCK,), 0, tl.int32), 0)
    s = stored.to(tl.float32, bitcast=True)
    byte_misses = tl.zeros((BLOCK,), tl.int32)
    float_misses = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, 65536, BLOCK):
        bits = (start + tl.arange(0, BLOCK)) << 16  # every BF16 pattern as float32 bits
        expo = bits & 0x7F800000
        finite = expo != 0x7F800000
        bits = tl.where(expo == 0, bits & -2147483648, bits)  # subnormals flush, as the kernel's load does
        v = bits.to(tl.float32, bitcast=True)
        held = finite & ((bits & 0x7FFFFFFF).to(tl.float32, bitcast=True) <= amax)
        y_ref = tl.math.div_rn(v, s)
        y_new = _divide(v, unit, rcp, pow2)
        # Quotients from 2**-12 up (E4M3's smallest subnormal is 2**-9, its smallest tie 2**-10)
        matters = (tl.abs(y_ref) >= 0.000244140625) & held
        float_misses += tl.where(matters & (y_ref.to(tl.int32, bitcast=True) != y_new.to(tl.int32, bitcast=True)),
                                 1, 0)
        q_ref = tl.minimum(tl.maximum(y_ref, -448.0), 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        q_new = tl.minimum(tl.maximum(y_new, -448.0), 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        byte_misses += tl.where(held & (q_ref != q_new), 1, 0)
    tl.store(out_ptr + 2 * pid, tl.sum(byte_misses, axis=0))
    tl.store(out_ptr + 2 * pid + 1, tl.sum(float_misses, axis=0))


def test_divide_equals_div_rn_for_every_bf16_pair():
    # Every block amax the kernel can meet: 0 and every positive normal BF16 (magnitudes are
    # taken after subnormals flush, and non-finite values never enter it).
    patterns = torch.arange(0x0080, 0x7F80, dtype=torch.int32)
    amax_bits = torch.cat([torch.zeros(1, dtype=torch.int32), patterns << 16]).cuda()
    out = torch.zeros(2 * amax_bits.numel(), dtype=torch.int32, device="cuda")
    _pairs_kernel[(amax_bits.numel(),)](amax_bits, out, BLOCK=1024, num_warps=4)
    per_amax = out.view(-1, 2)
    counts = per_amax.sum(dim=0).tolist()
    where = [f"{int(amax_bits[i].item()):#010x}: {per_amax[i].tolist()}"
             for i in torch.nonzero(per_amax.sum(dim=1)).flatten()[:5].tolist()]
    assert counts == [0, 0], (f"{counts[0]} E4M3 bytes and {counts[1]} quotients >= 2**-12 differ from div_rn; "
                              f"first amax (float32 bits: [bytes, quotients]) {where}")
