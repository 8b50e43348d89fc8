"""Pack/unpack kernels: torch reference vs numpy slicing, Triton (interpreted) vs both.

Every test checks every byte: regions against an independent numpy oracle, and the bytes
outside the regions (packed buffer gaps, untouched tensor elements) against their random
sentinel contents from before the call.
"""

from __future__ import annotations

import math

import elastic_refit.kernels as kernels
import numpy as np
import pytest
import torch
from elastic_refit.kernels import BoxRegion, PackProgram, packed_nbytes
from elastic_refit.kernels import _triton_backend as tb
from elastic_refit.kernels.boxes import MAX_STRIDED_DIMS, collapse, entries_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

DTYPES = [
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
    torch.complex64,
]
DTYPES += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]

needs_triton = pytest.mark.skipif(not tb.HAVE_TRITON, reason="triton not installed")


# -- helpers -------------------------------------------------------------------------------
def random_tensor(shape, dtype, gen: np.random.Generator, offset_bytes: int = 0) -> torch.Tensor:
    """Contiguous tensor of random bytes; ``offset_bytes`` places it misaligned in storage."""
    isz = torch.empty((), dtype=dtype).element_size()
    n = math.prod(shape) * isz
    raw = torch.from_numpy(gen.integers(0, 256, n + offset_bytes + isz, dtype=np.uint8))
    # A storage offset that is a multiple of itemsize keeps view(dtype) legal.
    start = offset_bytes - offset_bytes % isz if offset_bytes else 0
    return raw[start : start + n].view(dtype).reshape(shape)


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A copy of ``t``'s bytes as numpy, shape ``(*t.shape, itemsize)``."""
    isz = t.element_size()
    flat = t.contiguous().reshape(-1).view(torch.uint8).numpy().copy()
    return flat.reshape((*t.shape, isz))


def box_index(region: BoxRegion) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(region.offsets, region.lengths, strict=True))


def expected_pack(regions, tensors, before: np.ndarray) -> np.ndarray:
    """The packed buffer by numpy slicing; bytes outside the regions stay as ``before``."""
    out = before.copy()
    for r in regions:
        box = tensor_bytes(tensors[r.tensor_index])[box_index(r)].reshape(-1)
        out[r.packed_offset_bytes : r.packed_offset_bytes + box.size] = box
    return out


def expected_unpack(regions, packed: np.ndarray, before: list[np.ndarray]) -> list[np.ndarray]:
    out = [b.copy() for b in before]
    for r in regions:
        dst = out[r.tensor_index]
        view = dst[box_index(r)]
        n = view.size
        view[...] = packed[r.packed_offset_bytes : r.packed_offset_bytes + n].reshape(view.shape)
    return out


@st.composite
def programs(draw, max_tensors=4, max_dim=6, max_ndim=4, min_ndim=0, max_regions=3):
    """Random tensors (shape, dtype, misalignment) and non-overlapping regions on them."""
    num = draw(st.integers(1, max_tensors))
    shapes, dtypes, misalign = [], [], []
    for _ in range(num):
        ndim = draw(st.integers(min_ndim, max_ndim))
        # Zero-size dims occasionally; mostly real data so the copies are exercised.
        dim = st.integers(0, 19).map(lambda k, m=max_dim: 0 if k == 0 else 1 + k % m)
        shapes.append(tuple(draw(dim) for _ in range(ndim)))
        dtypes.append(draw(st.sampled_from(DTYPES)))
        misalign.append(draw(st.sampled_from([0, 0, 0, 1, 2, 4, 8])))
    regions: list[BoxRegion] = []
    cursor = draw(st.integers(0, 5))
    aligned = draw(st.booleans())
    for ti, shape in enumerate(shapes):
        isz = torch.empty((), dtype=dtypes[ti]).element_size()
        taken: list[BoxRegion] = []
        for _ in range(draw(st.integers(1, max_regions))):
            offs, lens = [], []
            for s in shape:
                empty = s == 0 or draw(st.integers(0, 24)) == 0
                o = draw(st.integers(0, s)) if empty else draw(st.integers(0, s - 1))
                offs.append(o)
                lens.append(0 if empty else draw(st.integers(1, s - o)))
            cand = BoxRegion(ti, tuple(offs), tuple(lens), 0)
            if cand.numel and any(t.numel and kernels.boxes.region_overlap(cand, t) for t in taken):
                continue  # keep destination boxes disjoint so unpack is well defined
            gap = draw(st.integers(0, 17))
            cursor += gap
            if aligned:
                cursor = -(-cursor // 16) * 16
            region = BoxRegion(ti, cand.offsets, cand.lengths, cursor)
            taken.append(region)
            regions.append(region)
            cursor += region.nbytes(isz)
    order = draw(st.permutations(range(len(regions))))
    return shapes, dtypes, misalign, [regions[i] for i in order]


def run_and_check(shapes, dtypes, misalign, regions, *, backend, seed, **kw):
    gen = np.random.default_rng(seed)
    prog = PackProgram(shapes, dtypes, regions, backend=backend, **kw)
    tensors = [
        random_tensor(s, d, gen, m) for s, d, m in zip(shapes, dtypes, misalign, strict=True)
    ]
    buf_misalign = int(gen.integers(0, 3)) * 5
    raw = torch.from_numpy(gen.integers(0, 256, prog.nbytes + 24 + buf_misalign, dtype=np.uint8))
    out = raw[buf_misalign:]
    before = out.numpy().copy()
    prog.pack(tensors, out)
    np.testing.assert_array_equal(out.numpy(), expected_pack(regions, tensors, before))

    # Unpack random packed bytes into random destinations; everything else must survive.
    packed = torch.from_numpy(gen.integers(0, 256, prog.nbytes + 3, dtype=np.uint8))
    dsts = [random_tensor(s, d, gen, m) for s, d, m in zip(shapes, dtypes, misalign, strict=True)]
    dst_before = [tensor_bytes(t) for t in dsts]
    prog.unpack(packed, dsts)
    want = expected_unpack(regions, packed.numpy(), dst_before)
    for i, (t, w) in enumerate(zip(dsts, want, strict=True)):
        np.testing.assert_array_equal(tensor_bytes(t), w, err_msg=f"tensor {i}")
    return prog


# -- torch reference -----------------------------------------------------------------------
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=programs(), seed=st.integers(0, 2**32 - 1))
def test_reference_matches_numpy(case, seed):
    run_and_check(*case, backend="torch", seed=seed)


def test_empty_program_and_empty_boxes():
    prog = PackProgram(
        [(3, 0, 2), (4,)],
        [torch.float32, torch.int8],
        [BoxRegion(0, (1, 0, 0), (2, 0, 2), 0), BoxRegion(1, (4,), (0,), 7)],
    )
    assert prog.nbytes == 0
    out = torch.empty(0, dtype=torch.uint8)
    prog.pack([torch.empty(3, 0, 2), torch.zeros(4, dtype=torch.int8)], out)
    assert PackProgram([], [], []).nbytes == 0


def test_packed_nbytes():
    regions = [BoxRegion(0, (0, 1), (2, 3), 10), BoxRegion(1, (2,), (5,), 0)]
    assert packed_nbytes(regions, [2, 8]) == max(10 + 12, 40)
    assert packed_nbytes([], []) == 0


# -- collapse / entries (the kernel's view of a box) ----------------------------------------
def run_entries(entries, tensor_flat: np.ndarray, nbytes: int) -> np.ndarray:
    """Execute entries with plain loops: an independent model of what the kernel does."""
    out = np.full(nbytes, -1, dtype=np.int64)
    for e in entries:
        (n0, s0), (n1, s1), (n2, s2) = e.dims
        p = e.packed_offset
        for i0 in range(n0):
            for i1 in range(n1):
                for i2 in range(n2):
                    t = e.tensor_offset + i0 * s0 + i1 * s1 + i2 * s2
                    assert (out[p : p + e.row_bytes] == -1).all(), "entries overlap"
                    out[p : p + e.row_bytes] = tensor_flat[t : t + e.row_bytes]
                    p += e.row_bytes
    return out


@settings(max_examples=150, deadline=None)
@given(
    case=programs(max_tensors=1, max_ndim=6, min_ndim=1, max_dim=5, max_regions=1),
    limit=st.sampled_from([16, 32, 48, 64, 256, 1 << 30]),
)
def test_entries_cover_box_in_order(case, limit):
    shapes, dtypes, _, regions = case
    isz = torch.empty((), dtype=dtypes[0]).element_size()
    for r in regions:
        if r.numel == 0:
            continue
        region = BoxRegion(0, r.offsets, r.lengths, 0)
        flat = np.arange(math.prod(shapes[0]) * isz, dtype=np.int64)
        want = flat.reshape((*shapes[0], isz))[box_index(region)].reshape(-1)
        entries = entries_for(region, shapes[0], isz, limit)
        got = run_entries(entries, flat, want.size)
        np.testing.assert_array_equal(got, want)
        for e in entries:
            assert len(e.dims) == MAX_STRIDED_DIMS
            assert e.nbytes <= max(limit, e.row_bytes)
            assert e.nbytes <= limit or all(c == 1 for c, _ in e.dims)


def test_collapse_merges_full_dims():
    # [E, I, H] box over a slice of I with H full: rows of (I/tp * H) bytes, one stride.
    r = BoxRegion(0, (0, 512, 0), (64, 512, 4096), 0)
    t_off, row_bytes, dims = collapse(r, (64, 2048, 4096), 2)
    assert (t_off, row_bytes, dims) == (512 * 4096 * 2, 512 * 4096 * 2, [(64, 2048 * 4096 * 2)])
    # Column slice of a matrix: one row per matrix row.
    r = BoxRegion(0, (0, 1024), (8192, 2048), 0)
    assert collapse(r, (8192, 8192), 2) == (2048, 4096, [(8192, 16384)])
    # Whole tensor: a single row.
    r = BoxRegion(0, (0, 0, 0), (2, 3, 4), 0)
    assert collapse(r, (2, 3, 4), 4) == (0, 96, [])
    # Full middle dim merges with the outer one: [a, full, partial] -> one strided dim.
    r = BoxRegion(0, (1, 0, 1), (2, 3, 2), 0)
    assert collapse(r, (4, 3, 5), 1) == (5 * 3 + 1, 2, [(6, 5)])


# -- validation ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(tensor_index=-1, offsets=(0,), lengths=(1,), packed_offset_bytes=0), "tensor_index"),
        (
            dict(tensor_index=True, offsets=(0,), lengths=(1,), packed_offset_bytes=0),
            "tensor_index",
        ),
        (dict(tensor_index=0, offsets=[0], lengths=(1,), packed_offset_bytes=0), "offsets"),
        (dict(tensor_index=0, offsets=(0,), lengths=(-1,), packed_offset_bytes=0), "lengths"),
        (dict(tensor_index=0, offsets=(0, 1), lengths=(1,), packed_offset_bytes=0), "rank"),
        (dict(tensor_index=0, offsets=(0,), lengths=(1,), packed_offset_bytes=-3), "packed_offset"),
    ],
)
def test_box_region_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BoxRegion(**kwargs)


@pytest.mark.parametrize(
    ("shapes", "dtypes", "regions", "match"),
    [
        (
            [(4, 5)],
            [torch.float32],
            [(0, (1, 3), (2, 3), 0)],
            r"region 0: .*out of bounds of tensor 0 shape \(4, 5\) in dim 1 \(3 \+ 3 > 5\)",
        ),
        (
            [(4, 5)],
            [torch.float32],
            [(1, (0, 0), (1, 1), 0)],
            r"region 0: tensor_index 1 out of range for 1 tensors",
        ),
        ([(4, 5)], [torch.float32], [(0, (0,), (1,), 0)], r"region 0: box of rank 1 for tensor 0"),
        (
            [(4, 5), (8,)],
            [torch.float32, torch.bfloat16],
            [(0, (0, 0), (1, 5), 0), (1, (0,), (4,), 16)],
            r"regions 0 \(tensor 0\) and 1 \(tensor 1\) overlap in the packed buffer: "
            r"bytes \[0, 20\) and \[16, 24\)",
        ),
        ([(4, 5)], [torch.float32], ["nonsense"], r"region 0: 'nonsense' is not a BoxRegion"),
        ([(4, 5)], [torch.float32, torch.int8], [], r"1 shapes but 2 dtypes"),
        ([(4, -5)], [torch.float32], [], r"shapes\[0\] must hold ints >= 0"),
        ([(4, 5)], ["float32"], [], r"dtypes\[0\] must be a torch.dtype"),
    ],
)
def test_program_validation(shapes, dtypes, regions, match):
    with pytest.raises(ValueError, match=match):
        PackProgram(shapes, dtypes, regions)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_call_validation(backend):
    prog = PackProgram(
        [(4, 6), (3,)],
        [torch.bfloat16, torch.float32],
        [BoxRegion(0, (1, 2), (2, 3), 0), BoxRegion(1, (0,), (3,), 12)],
        backend=backend,
    )
    a, b = torch.zeros(4, 6, dtype=torch.bfloat16), torch.zeros(3)
    out = torch.zeros(prog.nbytes, dtype=torch.uint8)
    with pytest.raises(
        ValueError, match=r"tensor 1: dtype torch.float16 != program's torch.float32"
    ):
        prog.pack([a, b.half()], out)
    with pytest.raises(ValueError, match=r"tensor 0: not contiguous"):
        prog.pack([torch.zeros(6, 4, dtype=torch.bfloat16).t(), b], out)
    with pytest.raises(ValueError, match=r"tensor 0: shape \(4, 5\) != program's \(4, 6\)"):
        prog.pack([torch.zeros(4, 5, dtype=torch.bfloat16), b], out)
    with pytest.raises(ValueError, match=r"expected 2 tensors, got 1"):
        prog.pack([a], out)
    with pytest.raises(ValueError, match=r"out has 23 bytes, the program needs 24"):
        prog.pack([a, b], out[:23])
    with pytest.raises(ValueError, match=r"out must be a contiguous 1-D torch.uint8"):
        prog.pack([a, b], out.view(torch.int8))
    with pytest.raises(ValueError, match=r"packed must be a contiguous 1-D torch.uint8"):
        prog.unpack(out.reshape(2, 12), [a, b])


def test_overlapping_boxes_pack_but_refuse_unpack():
    t = torch.arange(20, dtype=torch.int32).reshape(4, 5)
    regions = [BoxRegion(0, (0, 0), (2, 5), 0), BoxRegion(0, (1, 2), (3, 2), 40)]
    prog = PackProgram([t.shape], [t.dtype], regions)
    out = torch.zeros(prog.nbytes, dtype=torch.uint8)
    prog.pack([t], out)
    assert out[40:].view(torch.int32).tolist() == [7, 8, 12, 13, 17, 18]
    with pytest.raises(ValueError, match=r"regions 0 and 1 overlap inside tensor 0"):
        prog.unpack(out, [t])


def test_cuda_graph_binding_needs_cuda():
    prog = PackProgram([(4,)], [torch.float32], [BoxRegion(0, (0,), (4,), 0)])
    with pytest.raises(ValueError, match=r"cuda_graph needs a CUDA device and the triton backend"):
        prog.bind([torch.zeros(4)], torch.zeros(16, dtype=torch.uint8), cuda_graph=True)


def test_bad_options():
    with pytest.raises(ValueError, match="backend"):
        PackProgram([], [], [], backend="cuda")
    with pytest.raises(ValueError, match="tile_bytes"):
        PackProgram([], [], [], tile_bytes=1000)
    with pytest.raises(ValueError, match="max_entry_bytes"):
        PackProgram([], [], [], max_entry_bytes=24)


# -- Triton kernel, run by Triton's interpreter on CPU ---------------------------------------
@needs_triton
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=programs(max_tensors=3, max_dim=5, max_regions=2),
    seed=st.integers(0, 2**32 - 1),
    tile=st.sampled_from([64, 128, 512]),
)
def test_triton_interpreted_matches_numpy(case, seed, tile):
    prog = run_and_check(*case, backend="triton", seed=seed, tile_bytes=tile)
    assert prog.backend == "triton"


@needs_triton
@pytest.mark.parametrize(
    ("shape", "offsets", "lengths", "dtype"),
    [
        ((6, 40), (1, 8), (4, 32), torch.float32),  # 16-byte rows shorter than a tile
        ((3, 4, 64), (0, 1, 0), (3, 2, 64), torch.bfloat16),  # long rows: in-row fast path
        ((2, 3, 4, 10), (1, 1, 1, 2), (1, 2, 3, 7), torch.float16),  # 3 strided dims, 2-byte
        ((2, 2, 3, 2, 5, 4), (0, 1, 1, 0, 1, 1), (2, 1, 2, 2, 3, 2), torch.int8),  # > 3 dims
        ((5, 33), (0, 0), (5, 33), torch.float64),  # whole tensor, one row
        ((7, 9), (2, 3), (4, 5), torch.int32),  # 4-byte accesses
        ((7, 9), (2, 2), (4, 4), torch.int16),  # 8-byte accesses
        # 7 accesses per row, 4 per tile: the second tile ends one access past its row.
        ((3, 32), (0, 4), (3, 28), torch.float32),
    ],
)
def test_triton_interpreted_paths(shape, offsets, lengths, dtype):
    regions = [BoxRegion(0, offsets, lengths, 32)]
    run_and_check([shape], [dtype], [0], regions, backend="triton", seed=7, tile_bytes=64)


def random_program(gen: np.random.Generator, num_tensors: int, max_dim: int):
    """A larger random program than hypothesis likes to draw (multi-tile regions)."""
    shapes = [
        tuple(int(d) for d in gen.integers(1, max_dim + 1, gen.integers(1, 5)))
        for _ in range(num_tensors)
    ]
    dtypes = [DTYPES[i] for i in gen.integers(0, len(DTYPES), num_tensors)]
    regions, cursor = [], 0
    for ti, shape in enumerate(shapes):
        isz = torch.empty((), dtype=dtypes[ti]).element_size()
        # Two disjoint boxes per tensor: split dim 0 (or take one box if it has extent 1).
        cut = int(gen.integers(0, shape[0])) if shape[0] > 1 else shape[0]
        for lo, hi in ((0, cut), (cut, shape[0])):
            if hi <= lo:
                continue
            offs, lens = [lo], [hi - lo]
            for s in shape[1:]:
                o = int(gen.integers(0, s))
                offs.append(o)
                lens.append(int(gen.integers(1, s - o + 1)))
            cursor = (
                -(-cursor // 16) * 16 if gen.random() < 0.7 else cursor + int(gen.integers(0, 9))
            )
            r = BoxRegion(ti, tuple(offs), tuple(lens), cursor)
            regions.append(r)
            cursor += r.nbytes(isz)
    return shapes, dtypes, regions


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("seed", range(3))
def test_larger_random_programs(backend, seed):
    gen = np.random.default_rng(100 + seed)
    shapes, dtypes, regions = random_program(gen, num_tensors=5, max_dim=12)
    misalign = [int(m) for m in gen.choice([0, 0, 2, 4], len(shapes))]
    run_and_check(shapes, dtypes, misalign, regions, backend=backend, seed=seed, tile_bytes=256)


@needs_triton
def test_triton_interpreted_entry_split_and_misaligned():
    # A small max_entry_bytes forces the host-side split of long rows and of dim 0.
    shapes = [(4, 3, 32), (100,)]
    dtypes = [torch.float32, torch.bfloat16]
    regions = [BoxRegion(0, (0, 1, 0), (4, 2, 32), 0), BoxRegion(1, (3,), (90,), 1027)]
    for misalign in ([0, 0], [4, 2], [8, 6]):
        prog = run_and_check(
            shapes,
            dtypes,
            misalign,
            regions,
            backend="triton",
            seed=3,
            tile_bytes=64,
            max_entry_bytes=96,
        )
        assert prog._plan.num_entries > len(regions)


@needs_triton
def test_triton_one_launch_per_call(monkeypatch):
    calls = []
    real = tb._dispatch  # what every launch on the CPU (the interpreter) goes through
    monkeypatch.setattr(tb, "_dispatch", lambda *a: (calls.append(a[4]), real(*a)))
    shapes = [(8, 16), (33,), (2, 3, 5, 7)]
    dtypes = [torch.bfloat16, torch.float32, torch.int8]
    regions = [
        BoxRegion(0, (0, 4), (8, 8), 0),
        BoxRegion(1, (1,), (32,), 128),
        BoxRegion(2, (1, 0, 1, 2), (1, 3, 4, 5), 256),
        BoxRegion(0, (2, 0), (3, 4), 400),
    ]
    prog = run_and_check(
        shapes, dtypes, [0, 0, 0], regions, backend="triton", seed=1, tile_bytes=128
    )
    assert calls == [True, False]
    gen = np.random.default_rng(5)
    tensors = [random_tensor(s, d, gen) for s, d in zip(shapes, dtypes, strict=True)]
    out = torch.zeros(prog.nbytes, dtype=torch.uint8)
    binding = prog.bind(tensors, out)
    binding.pack()
    np.testing.assert_array_equal(
        out.numpy(), expected_pack(regions, tensors, np.zeros(prog.nbytes, np.uint8))
    )
    for t in tensors:
        t.zero_()
    binding.unpack()
    assert calls == [True, False, True, False]
    want = expected_unpack(
        regions, out.numpy(), [tensor_bytes(torch.zeros_like(t)) for t in tensors]
    )
    for t, w in zip(tensors, want, strict=True):
        np.testing.assert_array_equal(tensor_bytes(t), w)


@needs_triton
def test_triton_pointer_table_follows_new_tensors():
    # The per-call table is cached by addresses: new tensors must not reuse a stale table.
    regions = [BoxRegion(0, (1,), (6,), 0)]
    prog = PackProgram([(8,)], [torch.int16], regions, backend="triton", tile_bytes=64)
    for k in range(3):
        t = torch.arange(8, dtype=torch.int16) + 100 * k
        out = torch.zeros(12, dtype=torch.uint8)
        prog.pack([t], out)
        assert out.view(torch.int16).tolist() == list(range(1 + 100 * k, 7 + 100 * k))


def test_warm_up_refuses_an_unknown_backend_and_runs_on_the_cpu():
    from elastic_refit.kernels import warm_up

    warm_up("cpu")  # the torch backend here; on a GPU it compiles both Triton variants
    warm_up("cpu", deltas=True)  # the delta kernels run only where Triton does (a GPU): nothing here
    with pytest.raises(ValueError, match="backend must be one of"):
        warm_up("cpu", backend="cuda-graphs")
