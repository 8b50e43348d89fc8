"""Triton pack/unpack on CUDA vs the torch reference, bit-exact (auto-skipped without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from elastic_refit.kernels import BoxRegion, PackProgram
from elastic_refit.kernels import _triton_backend as tb

from tests.unit.test_kernels import DTYPES, random_program

pytestmark = pytest.mark.gpu
DEV = "cuda"


def rand_bytes(n: int, gen: torch.Generator, offset: int = 0) -> torch.Tensor:
    """``n`` random bytes on the GPU starting ``offset`` bytes into a fresh allocation."""
    raw = torch.randint(0, 256, (n + offset,), dtype=torch.uint8, device=DEV, generator=gen)
    return raw[offset:]


def rand_tensor(shape, dtype, gen: torch.Generator, offset: int = 0) -> torch.Tensor:
    isz = torch.empty((), dtype=dtype).element_size()
    n = int(np.prod(shape)) * isz
    off = offset - offset % isz  # storage offsets must be whole elements
    return rand_bytes(n, gen, off).view(dtype).reshape(shape)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def check_against_reference(shapes, dtypes, regions, *, seed, misalign=None, buf_off=0, **kw):
    """Triton and torch from identical random starting bytes must end identical, all bytes."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    misalign = misalign or [0] * len(shapes)
    tri = PackProgram(shapes, dtypes, regions, device=DEV, backend="triton", **kw)
    ref = PackProgram(shapes, dtypes, regions, device=DEV, backend="torch")
    assert tri.backend == "triton"
    tensors = [rand_tensor(s, d, gen, m) for s, d, m in zip(shapes, dtypes, misalign, strict=True)]
    out_t = rand_bytes(tri.nbytes + 64, gen, buf_off)
    out_r = out_t.clone()
    tri.pack(tensors, out_t)
    ref.pack(tensors, out_r)
    torch.cuda.synchronize()
    assert torch.equal(out_t, out_r), "pack differs from the reference"

    packed = rand_bytes(tri.nbytes + 64, gen, buf_off)
    dst_t = [rand_tensor(s, d, gen, m) for s, d, m in zip(shapes, dtypes, misalign, strict=True)]
    dst_r = [t.clone() for t in dst_t]
    tri.unpack(packed, dst_t)
    ref.unpack(packed, dst_r)
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(dst_t, dst_r, strict=True)):
        assert torch.equal(as_bytes(a), as_bytes(b)), f"unpack differs in tensor {i}"
    return tri


@pytest.mark.parametrize("seed", range(12))
def test_random_programs(seed):
    gen = np.random.default_rng(seed)
    shapes, dtypes, regions = random_program(gen, num_tensors=8, max_dim=48)
    misalign = [int(m) for m in gen.choice([0, 0, 0, 1, 2, 4, 8], len(shapes))]
    tile = int(gen.choice([1024, 4096, 16384]))
    check_against_reference(
        shapes,
        dtypes,
        regions,
        seed=seed,
        misalign=misalign,
        buf_off=int(gen.choice([0, 0, 3, 8])),
        tile_bytes=tile,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_column_slices(dtype):
    shape = (96, 520)
    regions = [
        BoxRegion(0, (0, c), (96, 130), k * 96 * 130 * 8) for k, c in enumerate(range(0, 520, 130))
    ]
    # Packed slots sized for the widest dtype (8 bytes), so narrower ones leave gaps.
    check_against_reference([shape], [dtype], regions, seed=1)


def test_expert_tp_slices():
    e, i, h, tp = 16, 1024, 512, 4
    step = i // tp
    nb = e * step * h * 2
    regions = [BoxRegion(0, (0, k * step, 0), (e, step, h), k * nb) for k in range(tp)]
    check_against_reference([(e, i, h)], [torch.bfloat16], regions, seed=2)


def test_many_norm_vectors():
    shapes = [(4096,)] * 150 + [(7168,)] * 150
    dtypes = [torch.bfloat16] * 150 + [torch.float32] * 150
    regions, cur = [], 0
    for t, (s, d) in enumerate(zip(shapes, dtypes, strict=True)):
        regions.append(BoxRegion(t, (0,), s, cur))
        cur += s[0] * torch.empty((), dtype=d).element_size()
    check_against_reference(shapes, dtypes, regions, seed=3)


def test_region_over_one_gib_is_split():
    # 1.5 GiB in one region: split host-side into <= 1 GiB entries so int32 indexing holds.
    n = 3 << 28
    regions = [BoxRegion(0, (16,), (n - 32,), 16)]
    prog = check_against_reference([(n,)], [torch.int16], regions, seed=4)
    assert prog._plan.num_entries == 2  # 1 GiB + the rest


def test_unaligned_everything():
    shapes = [(33, 17), (5, 7, 11)]
    dtypes = [torch.int8, torch.float16]
    regions = [BoxRegion(0, (1, 3), (30, 13), 1), BoxRegion(1, (1, 2, 3), (3, 5, 7), 400)]
    for mis in ([1, 2], [3, 6], [0, 0]):
        check_against_reference(shapes, dtypes, regions, seed=5, misalign=mis, buf_off=1)


def test_bound_pack_in_cuda_graph():
    gen = torch.Generator(device=DEV).manual_seed(6)
    w = rand_tensor((64, 256), torch.bfloat16, gen)
    regions = [BoxRegion(0, (0, 64), (64, 128), 0)]
    prog = PackProgram([w.shape], [w.dtype], regions, device=DEV, backend="triton")
    buf = torch.empty(prog.nbytes, dtype=torch.uint8, device=DEV)
    binding = prog.bind([w], buf)
    binding.pack()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        binding.pack()
    w.copy_(rand_tensor(w.shape, w.dtype, gen))
    graph.replay()
    torch.cuda.synchronize()
    # Compare bytes: random bf16 bit patterns include NaNs, which never compare equal.
    assert torch.equal(buf, as_bytes(w[:, 64:192].contiguous()))


def test_binding_with_cuda_graph_replays():
    gen = torch.Generator(device=DEV).manual_seed(7)
    shapes = [(4096,)] * 40 + [(96, 200)]
    dtypes = [torch.bfloat16] * 40 + [torch.float32]
    regions = [BoxRegion(i, (0,), (4096,), i * 8192) for i in range(40)]
    regions.append(BoxRegion(40, (8, 16), (80, 100), 40 * 8192))
    prog = PackProgram(shapes, dtypes, regions, device=DEV, backend="triton")
    src = [rand_tensor(s, d, gen) for s, d in zip(shapes, dtypes, strict=True)]
    dst = [rand_tensor(s, d, gen) for s, d in zip(shapes, dtypes, strict=True)]
    buf = torch.empty(prog.nbytes, dtype=torch.uint8, device=DEV)
    pack_b = prog.bind(src, buf, cuda_graph=True)
    unpack_b = prog.bind(dst, buf, cuda_graph=True)
    ref = PackProgram(shapes, dtypes, regions, device=DEV, backend="torch")
    for step in range(3):  # step 0 captures, later steps replay
        for t in src:
            as_bytes(t).copy_(rand_bytes(as_bytes(t).numel(), gen))
        want_dst = [t.clone() for t in dst]
        want_buf = buf.clone()
        ref.pack(src, want_buf)
        ref.unpack(want_buf, want_dst)
        pack_b.pack()
        unpack_b.unpack()
        torch.cuda.synchronize()
        assert torch.equal(buf, want_buf), f"step {step}"
        for a, b in zip(dst, want_dst, strict=True):
            assert torch.equal(as_bytes(a), as_bytes(b)), f"step {step}"
    assert set(pack_b._graphs) == {True} and set(unpack_b._graphs) == {False}


# ---- direct launches (issue 39): after the first call, straight to the compiled kernel -----
def _small_vectors(n: int, length: int, dtype: torch.dtype) -> tuple[list, list, list]:
    isz = torch.empty((), dtype=dtype).element_size()
    shapes = [(length,)] * n
    return shapes, [dtype] * n, [BoxRegion(i, (0,), (length,), i * length * isz) for i in range(n)]


@pytest.mark.parametrize("buf_off", [0, 2, 8])  # each alignment of the buffer its own specialisation
def test_bound_calls_launch_directly_and_stay_bit_exact(buf_off):
    gen = torch.Generator(device=DEV).manual_seed(11 + buf_off)
    shapes, dtypes, regions = _small_vectors(256, 4096, torch.bfloat16)
    shapes.append((96, 200))
    dtypes.append(torch.float32)
    regions.append(BoxRegion(256, (8, 16), (80, 100), 256 * 8192))
    prog = PackProgram(shapes, dtypes, regions, device=DEV, backend="triton")
    ref = PackProgram(shapes, dtypes, regions, device=DEV, backend="torch")
    src = [rand_tensor(s, d, gen) for s, d in zip(shapes, dtypes, strict=True)]
    dst = [rand_tensor(s, d, gen) for s, d in zip(shapes, dtypes, strict=True)]
    buf = rand_bytes(prog.nbytes, gen, buf_off)
    pack_b, unpack_b = prog.bind(src, buf), prog.bind(dst, buf)
    before = tb.direct_stats()
    for step in range(4):  # the first call of each direction may compile; later ones go direct
        for t in src:
            as_bytes(t).copy_(rand_bytes(as_bytes(t).numel(), gen))
        want_buf, want_dst = buf.clone(), [t.clone() for t in dst]
        ref.pack(src, want_buf)
        ref.unpack(want_buf, want_dst)
        pack_b.pack()
        unpack_b.unpack()
        torch.cuda.synchronize()
        assert torch.equal(buf, want_buf), f"step {step}"
        for i, (a, b) in enumerate(zip(dst, want_dst, strict=True)):
            assert torch.equal(as_bytes(a), as_bytes(b)), f"step {step} tensor {i}"
    after = tb.direct_stats()
    assert after["enabled"] == 1, after
    assert after["direct"] - before["direct"] >= 6, (before, after)  # steps 1-3, both directions


def test_unbound_calls_launch_directly_on_any_stream():
    gen = torch.Generator(device=DEV).manual_seed(12)
    shapes, dtypes, regions = _small_vectors(64, 7168, torch.float32)
    prog = PackProgram(shapes, dtypes, regions, device=DEV, backend="triton")
    ref = PackProgram(shapes, dtypes, regions, device=DEV, backend="torch")
    src = [rand_tensor(s, d, gen) for s, d in zip(shapes, dtypes, strict=True)]
    prog.pack(src, torch.empty(prog.nbytes, dtype=torch.uint8, device=DEV))  # compiles
    before = tb.direct_stats()["direct"]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # a launch goes to the caller's current stream
        out = torch.empty(prog.nbytes, dtype=torch.uint8, device=DEV)
        prog.pack(src, out)
        want = torch.empty_like(out)
        ref.pack(src, want)
    side.synchronize()
    assert torch.equal(out, want)
    assert tb.direct_stats()["direct"] > before


def test_direct_launches_step_aside_for_triton_launch_hooks():
    from triton import knobs

    gen = torch.Generator(device=DEV).manual_seed(13)
    shapes, dtypes, regions = _small_vectors(8, 4096, torch.bfloat16)
    prog = PackProgram(shapes, dtypes, regions, device=DEV, backend="triton")
    src = [rand_tensor(s, d, gen) for s, d in zip(shapes, dtypes, strict=True)]
    buf = torch.empty(prog.nbytes, dtype=torch.uint8, device=DEV)
    binding = prog.bind(src, buf)
    binding.pack()
    seen = []
    hook = lambda metadata: seen.append(metadata)  # noqa: E731 - a profiler's hook
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        binding.pack()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert seen, "a launch hook set by a profiler was not called"
    assert torch.equal(buf, torch.cat([as_bytes(t) for t in src]))
