"""The fused delta kernels (``kernels.delta_triton``) through Triton's CPU interpreter: the
very kernels CUDA runs, bit-exact against the torch reference, and the codec's CUDA path
(``kernels.delta``, ``transport.delta_boxes``' vectorized form) with them in. Skipped where
Triton is not installed (the CPU CI); tests/gpu/test_delta_triton_gpu.py runs them compiled."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from elastic_refit.kernels import delta as codec
from elastic_refit.kernels import delta_triton

from elastic_refit.transport.delta_boxes import Boxes
from elastic_refit.transport.schedule import BoxCopy
from tests.delta_reference import assert_encode_and_scatter_match_torch

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]


def _pair(n: int, dtype: torch.dtype, density, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 100, (n,), generator=g).to(dtype)
    cur = base.clone()
    if density == "one":
        cur[(n * 7) // 11] += 1
    else:
        cur[torch.rand(n, generator=g) < density] += 1
    return cur, base


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 9, delta_triton.BLOCK, delta_triton.BLOCK + 1, 3 * delta_triton.BLOCK - 5])
@pytest.mark.parametrize("density", [0.0, "one", 0.03, 1.0])
def test_encode_and_scatter_equal_the_reference(dtype, n, density):
    assert_encode_and_scatter_match_torch(*_pair(n, dtype, density, n))


def test_bad_inputs_are_value_errors():
    a = torch.zeros(8, dtype=torch.int16)
    with pytest.raises(ValueError):
        delta_triton.encode_changes(a, torch.zeros(9, dtype=torch.int16))
    with pytest.raises(ValueError):
        delta_triton.encode_changes(a.float(), a.float())
    with pytest.raises(ValueError):
        delta_triton.scatter(a, torch.zeros(2, dtype=torch.int32), a[:2])
    with pytest.raises(ValueError):
        delta_triton.scatter(a, torch.zeros(2, dtype=torch.int64), a[:3])


@pytest.fixture
def interpreted(monkeypatch):
    """The codec takes its CUDA path (the fused kernels) for CPU tensors, interpreted;
    yields the number of launches of each kernel function, counted."""
    monkeypatch.setattr(delta_triton, "_interpret_cpu", True)
    calls = {"encode_changes": 0, "scatter": 0}

    def counting(name: str):
        fn = getattr(delta_triton, name)

        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted

    for name in calls:
        monkeypatch.setattr(delta_triton, name, counting(name))
    return calls


@pytest.mark.parametrize("unit", [1, 2, 4])
@pytest.mark.parametrize("density", [0.0, "one", 0.05, 1.0])
def test_the_flat_codec_with_the_kernels_equals_the_torch_form(interpreted, unit, density):
    cur, base = _pair(5000 * unit, torch.uint8, density, unit)
    assert delta_triton.usable(cur)
    with_kernels = codec.encode_delta(cur, base, unit)
    delta_triton.set_enabled(False)
    try:
        reference = codec.encode_delta(cur, base, unit)
        assert torch.equal(codec.changed_elements(cur, base, unit), (cur.view(-1, unit) != base.view(-1, unit)).any(1)
                           .nonzero().flatten())
    finally:
        delta_triton.set_enabled(True)
    assert torch.equal(with_kernels, reference)
    assert torch.equal(codec.changed_elements(cur, base, unit),
                       (cur.view(-1, unit) != base.view(-1, unit)).any(1).nonzero().flatten())
    target = base.clone()
    codec.apply_delta(with_kernels, target, unit)
    assert torch.equal(target, cur)
    assert interpreted["encode_changes"] == 2 and interpreted["scatter"] == (density != 0.0)


@pytest.mark.parametrize("density", [0.0, 0.02, 1.0])
def test_the_box_codec_with_the_kernels_equals_the_numpy_form(interpreted, density):
    """A TP shard's boxes (half the columns each, in reverse order) and a whole buffer of
    another element size: segments and digest moves as the CPU form codes them, and
    applying them rebuilds the version."""
    g = torch.Generator().manual_seed(3)
    w, v = (0, "w"), (0, "v")
    buffers = {w: SimpleNamespace(shape=(96, 80), dtype="bfloat16"), v: SimpleNamespace(shape=(50, 3), dtype="float32")}
    boxes = (BoxCopy(w, (0, 40), (96, 40), 0, 0), BoxCopy(w, (0, 0), (96, 40), 0, 0), BoxCopy(v, (0, 0), (50, 3), 0, 0))
    base, cur = {}, {}
    for ref, b in buffers.items():
        dtype = getattr(torch, b.dtype)
        raw = torch.randint(0, 256, (*b.shape, dtype.itemsize), dtype=torch.uint8, generator=g)
        base[ref] = raw.view(dtype).reshape(b.shape)
        changed = raw.clone()
        changed[..., 0][torch.rand(b.shape, generator=g) < density] ^= 0x11
        cur[ref] = changed.view(dtype).reshape(b.shape)
    schedule = SimpleNamespace(buffers=buffers)
    cpu = Boxes(boxes, schedule, torch.device("cpu"))
    vec = Boxes(boxes, schedule, torch.device("cpu"), vectorized=True)
    a, b = cpu.segments(cur, base, True), vec.segments(cur, base, True)
    for field in ("entries", "value_bytes", "coded", "moves"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    target = {r: t.clone() for r, t in base.items()}
    moves, written = vec.apply_segments(target, a, True)
    assert torch.equal(moves, a.moves)
    written.finish(True)
    for r, t in target.items():
        assert torch.equal(t.view(torch.uint8), cur[r].view(torch.uint8)), r
    assert interpreted["encode_changes"] == 2  # one compare per buffer
    assert interpreted["scatter"] == (2 if density else 0)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("k", [0, 1, delta_triton.SCATTER_BLOCK + 3])
def test_gather_and_scatter_over_many_buffers_equal_the_reference(dtype, k):
    g = torch.Generator().manual_seed(k)
    buffers = [torch.randint(-100, 100, (n,), generator=g).to(dtype) for n in (7, 3000, 1, 512)]
    pairs = [(r, i) for r, b in enumerate(buffers) for i in range(b.numel())]
    pick = torch.randperm(len(pairs), generator=g)[:k].tolist()
    ref = torch.tensor([pairs[j][0] for j in pick], dtype=torch.int64)
    index = torch.tensor([pairs[j][1] for j in pick], dtype=torch.int64)
    got = delta_triton.gather_many(buffers, ref, index)
    assert torch.equal(got, torch.stack([buffers[r][i] for r, i in zip(ref.tolist(), index.tolist(), strict=True)])
                       if k else got[:0])
    values = torch.randint(-100, 100, (k,), generator=g).to(dtype)
    want = [b.clone() for b in buffers]
    for r, i, v in zip(ref.tolist(), index.tolist(), values, strict=True):
        want[r][i] = v
    delta_triton.scatter_many(buffers, ref, index, values)
    for b, w in zip(buffers, want, strict=True):
        assert torch.equal(b, w)


def test_many_buffer_kernels_refuse_mixed_buffers_by_name():
    a, b = torch.zeros(4, dtype=torch.int16), torch.zeros(4, dtype=torch.int32)
    one = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"buffers\[1\] is torch.int32"):
        delta_triton.gather_many([a, b], one, one)
    with pytest.raises(ValueError, match="ref must be a flat contiguous int64"):
        delta_triton.gather_many([a], one.to(torch.int32), one)
    with pytest.raises(ValueError, match="values"):
        delta_triton.scatter_many([a], one, one, torch.zeros(2, dtype=torch.int16))


def test_warm_up_runs_every_delta_kernel_once_per_element_size(interpreted, monkeypatch):
    """A member with deltas compiles the delta kernels before it joins (its first delta
    refit must not): every kernel, for elements of 1, 2, 4 and 8 bytes; the compare with
    and without the changed values, sparse and dense (four compaction variants)."""
    many = {"gather_many": 0, "scatter_many": 0}
    for name in many:
        fn = getattr(delta_triton, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            many[_name] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(delta_triton, name, counted)
    assert delta_triton.warm_up("cpu") == 4
    assert interpreted == {"encode_changes": 16, "scatter": 4} and many == {"gather_many": 4, "scatter_many": 4}
    delta_triton.set_enabled(False)
    try:
        assert delta_triton.warm_up("cpu") == 0  # turned off: nothing runs
    finally:
        delta_triton.set_enabled(True)
