"""The fused delta kernels compiled on CUDA (``kernels.delta_triton``, gpu marker): bit-exact
against the torch reference over random sizes, element sizes and densities (nothing changed,
one element, a few percent, everything), a run past 2**31 elements (64-bit offsets), and
the codec's CUDA path with the kernels in giving what the torch form gives."""

from __future__ import annotations

import random

import pytest
import torch
from elastic_refit.kernels import delta as codec
from elastic_refit.kernels import delta_triton

from tests.delta_reference import assert_encode_and_scatter_match_torch

pytestmark = pytest.mark.gpu

DTYPES = [torch.uint8, torch.int16, torch.int32, torch.int64]
_rng = random.Random(35)
SIZES = [1, 7, delta_triton.BLOCK, delta_triton.BLOCK + 1] + sorted(_rng.randrange(2, 3_000_000) for _ in range(4))


@pytest.fixture(autouse=True)
def _triton():
    if not delta_triton.HAVE_TRITON:
        pytest.fail("triton does not import on this GPU machine: the fused delta kernels cannot run")
    t = torch.zeros(1, device="cuda")
    assert delta_triton.usable(t), "the fused delta kernels are turned off (ELASTIC_REFIT_DELTA_KERNELS=torch?)"


def _pair(n: int, dtype: torch.dtype, density, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    base = torch.randint(-100, 100, (n,), generator=g, device="cuda").to(dtype)
    cur = base.clone()
    if density == "one":
        cur[(n * 7) // 11] += 1
    elif density:
        cur[torch.rand(n, generator=g, device="cuda") < density] += 1
    return cur, base


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("density", [0.0, "one", 0.013, 0.13, 1.0])
def test_encode_and_scatter_equal_the_torch_reference(dtype, n, density):
    assert_encode_and_scatter_match_torch(*_pair(n, dtype, density, n))


def test_a_run_past_two_to_the_31_elements():
    """64-bit offsets: changes on both sides of element 2**31 and in the last block."""
    n = 2**31 + 3 * delta_triton.BLOCK + 5
    base = torch.zeros(n, dtype=torch.uint8, device="cuda")
    cur = base.clone()
    where = torch.tensor([0, 2**31 - 1, 2**31, 2**31 + 1, n - 1], device="cuda")
    cur[where] = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8, device="cuda")
    index, values = delta_triton.encode_changes(cur, base)
    assert torch.equal(index, where) and values.tolist() == [1, 2, 3, 4, 5]
    delta_triton.scatter(base, index, values)
    assert torch.equal(base[where], cur[where]) and int(base.count_nonzero()) == 5


@pytest.mark.parametrize("unit", [1, 2, 4, 8])
@pytest.mark.parametrize("density", [0.0, "one", 0.02, 1.0])
def test_the_flat_codec_with_the_kernels_equals_the_torch_form(unit, density):
    cur, base = _pair(1_000_003 * unit, torch.uint8, density, unit)
    fused = codec.encode_delta(cur, base, unit)
    previous = delta_triton.set_enabled(False)
    try:
        reference = codec.encode_delta(cur, base, unit)
    finally:
        delta_triton.set_enabled(previous)
    assert torch.equal(fused, reference)
    target = base.clone()
    codec.apply_delta(fused, target, unit)
    assert torch.equal(target, cur)


@pytest.mark.parametrize("unit", [1, 2, 4, 8])
@pytest.mark.parametrize("k", [0, 1, 1000, 300_001])
def test_elements_of_many_buffers_fused_equal_the_torch_form(unit, k):
    """The box codec's reads and writes over all of a message's buffers in one launch each
    (gather_many / scatter_many) against a gather and a write per buffer."""
    g = torch.Generator(device="cuda").manual_seed(unit * 7 + k)
    sizes = [5, 200_000, 1, 150_000, 3]
    buffers = [torch.randint(0, 256, (n * unit,), dtype=torch.uint8, generator=g, device="cuda") for n in sizes]
    firsts = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()[:-1]], device="cuda")
    pick = torch.randperm(sum(sizes), generator=g, device="cuda")[:k]  # distinct elements, any order
    ref = (torch.searchsorted(firsts, pick, right=True) - 1).contiguous()
    index = (pick - firsts[ref]).contiguous()
    fused = codec.gather_elements_many(buffers, ref, index, unit)
    previous = delta_triton.set_enabled(False)
    try:
        reference = codec.gather_elements_many(buffers, ref, index, unit)
        rows = torch.randint(0, 256, (k, unit), dtype=torch.uint8, generator=g, device="cuda")
        want = [b.clone() for b in buffers]
        codec.write_elements_many(want, ref, index, rows, unit)
    finally:
        delta_triton.set_enabled(previous)
    assert torch.equal(fused, reference)
    codec.write_elements_many(buffers, ref, index, rows, unit)
    for got, expected in zip(buffers, want, strict=True):
        assert torch.equal(got, expected)


def _num_compiled() -> int:
    """Kernel variants compiled (or loaded) so far on this device, all delta kernels."""
    mod = delta_triton._module(torch.zeros(1, device="cuda"))
    device = torch.cuda.current_device()
    return sum(len(getattr(mod, name).device_caches[device][0]) for name in
               ("flag_kernel", "compact_sparse_kernel", "compact_dense_kernel", "scatter_kernel", "gather_many_kernel",
                "scatter_many_kernel"))


def test_after_warm_up_no_size_or_offset_compiles_another_variant():
    # Sizes divisible by 16, equal to 1 and neither, values and indices at odd offsets of a
    # message: each used to be a variant of its own, compiled inside a timed refit.
    assert delta_triton.warm_up("cuda") == 4
    before = _num_compiled()
    for dtype, density in ((d, p) for d in DTYPES for p in (0.01, 0.3)):  # both compactions
        for n in (1, 16, 1024, 4099):
            cur, base = _pair(n, dtype, density, seed=n)
            index, values = delta_triton.encode_changes(cur, base)
            assert torch.equal(delta_triton.encode_changes(cur, base, values=False)[0], index)
            stream = torch.cat([values[:1], values])  # values one element into a larger message
            index_stream = torch.cat([index[:1], index])
            target = base.clone()
            delta_triton.scatter(target, index_stream[1:], stream[1:])
            assert torch.equal(target, cur)
            ref = torch.zeros_like(index_stream)
            target = base.clone()
            got = delta_triton.gather_many([cur, base], ref[1:], index_stream[1:])
            delta_triton.scatter_many([target, cur], ref[1:], index_stream[1:], torch.cat([got[:1], got])[1:])
            assert torch.equal(target, cur)
    assert _num_compiled() == before, "a call after warm_up compiled a new kernel variant"


def test_the_delta_codec_warms_once_per_device():
    from elastic_refit.transport import delta_warm

    first = delta_warm.warm_up("cuda")
    assert first in (0, 4)  # 0: another test of this process warmed it already
    assert delta_warm.warm_up("cuda") == 0
    assert delta_warm.exercise(torch.device("cuda")) == 4  # and it runs, checked, on the GPU
