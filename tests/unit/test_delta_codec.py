"""Delta coding (``elastic_refit.kernels.delta``): whatever the base and the change (none,
one element, all, runs longer than a skip, FP8 blocks whose scale moved), applying the
payload to the base gives the current bytes exactly, and the payload is as small as the
format says."""

from __future__ import annotations

import pytest
import torch
from elastic_refit.kernels.delta import (
    HEADER_BYTES,
    apply_delta,
    changed_elements,
    delta_unit,
    encode_delta,
    encoded_nbytes,
)
from elastic_refit.kernels.quantize import quantize_reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_refit.layout.formats import DestinationFormat

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _roundtrip(current: torch.Tensor, base: torch.Tensor, unit: int) -> torch.Tensor:
    payload = encode_delta(current, base, unit)
    changed = changed_elements(current, base, unit)
    assert payload.numel() == encoded_nbytes(changed, unit)
    target = base.clone()
    assert apply_delta(payload, target, unit) == changed.numel()
    assert torch.equal(target, current)
    return payload


@st.composite
def base_and_change(draw):
    unit = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(0, 3000))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (n * unit,), dtype=torch.uint8, generator=g)
    current = base.clone()
    kind = draw(st.sampled_from(["none", "one", "all", "random", "runs", "last", "one-byte"]))
    rows = current.view(-1, unit)
    if n and kind == "one":
        rows[draw(st.integers(0, n - 1))] += 1
    elif n and kind == "last":
        rows[n - 1] ^= 0x80
    elif kind == "all":
        rows.add_(1)
    elif n and kind == "random":
        mask = torch.rand(n, generator=g) < draw(st.floats(0.0, 1.0))
        rows[mask] ^= 0x01
    elif n and kind == "runs":  # far apart: gaps of several skips
        for i in range(draw(st.integers(0, n - 1)) % 300, n, draw(st.integers(256, 1200))):
            rows[i] ^= 0x40
    elif n and kind == "one-byte":  # one byte of a multi-byte element
        rows[draw(st.integers(0, n - 1)), unit - 1] ^= 0x02
    return unit, base, current


@SETTINGS
@given(base_and_change())
def test_apply_of_encode_is_the_current_bytes(case):
    unit, base, current = case
    _roundtrip(current, base, unit)


@SETTINGS
@given(st.integers(1, 2000), st.integers(0, 2**31 - 1))
def test_bf16_changes_are_compared_bit_for_bit(n, seed):
    """-0.0 vs 0.0 and NaN payloads are changes; the same NaN bits are not."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=g).to(torch.bfloat16)
    base[0] = 0.0
    current = base.clone()
    current[0] = -0.0
    if n > 1:
        base[-1] = float("nan")
        current[-1] = float("nan")
    b, c = base.view(torch.uint8), current.view(torch.uint8)
    changed = changed_elements(c, b, 2)
    assert changed.tolist() == [0]
    _roundtrip(c, b, 2)


def test_sizes_follow_the_format():
    unit = 2
    base = torch.zeros(10_000 * unit, dtype=torch.uint8)
    assert encode_delta(base, base, unit).numel() == HEADER_BYTES  # nothing changed
    current = base.clone()
    current.view(torch.int16)[[0, 254, 255, 5000]] = 7
    payload = _roundtrip(current, base, unit)
    # gaps 0, 253, 0 and 4744 (18 skips): 4 entries + 18 skips + 4 values of 2 bytes
    assert payload.numel() == HEADER_BYTES + 4 + 18 + 4 * unit
    everything = base + 1
    assert _roundtrip(everything, base, unit).numel() == HEADER_BYTES + 10_000 * (1 + unit)


def test_encode_may_write_over_the_current_bytes():
    """A sender encodes into the staging its current bytes were packed into."""
    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
    current = base.clone()
    current[::97] += 1
    staging = current.clone()
    payload = encode_delta(staging, base, 1, out=staging)
    assert payload.data_ptr() == staging.data_ptr()
    target = base.clone()
    apply_delta(payload.clone(), target, 1)
    assert torch.equal(target, current)


def test_unaligned_views_fall_back_to_rows():
    data = torch.zeros(4097, dtype=torch.uint8)
    base, current = data[1:], data[1:].clone()
    current[10] = 1
    assert changed_elements(current, base, 4).tolist() == [2]
    _roundtrip(current, base.clone(), 4)


@pytest.mark.parametrize("bad", [
    lambda p: p[:-1],  # truncated
    lambda p: torch.cat([p, p[-1:]]),  # one byte too many
])
def test_a_payload_that_does_not_fit_is_refused(bad):
    base = torch.zeros(64, dtype=torch.uint8)
    current = base.clone()
    current[5] = 1
    with pytest.raises(ValueError):
        apply_delta(bad(encode_delta(current, base, 1)), base.clone(), 1)


def test_delta_unit():
    assert delta_unit([2, 2]) == 2
    assert delta_unit([2, 4]) == 2
    assert delta_unit([1, 4]) == 1
    with pytest.raises(ValueError):
        delta_unit([])


FP8_16 = DestinationFormat("fp8-block16")


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.sampled_from(["scale-moves", "inside-block", "none"]))
def test_fp8_blocks_whose_scale_moves(seed, kind):
    """FP8 bytes and their scales packed in one bucket (as a quantized refit sends them):
    when a change moves a block's amax, every byte of the block and its scale may change;
    the delta still rebuilds the bucket exactly, and when it is not smaller than the bucket
    a sender sends the bytes instead (the size says so)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 48, generator=g).to(torch.bfloat16)
    q0, s0 = quantize_reference(w, FP8_16)
    w1 = w.clone()
    if kind == "scale-moves":
        w1[3, 5] = w1[:16, :16].abs().max() * 4  # this block's amax, hence its scale
    elif kind == "inside-block":
        w1[20, 40] = w1[20, 40] * 0.5
    q1, s1 = quantize_reference(w1, FP8_16)
    base = torch.cat([q0.view(torch.uint8).flatten(), s0.contiguous().view(torch.uint8).flatten()])
    current = torch.cat([q1.view(torch.uint8).flatten(), s1.contiguous().view(torch.uint8).flatten()])
    unit = delta_unit([1, s0.element_size()])
    payload = _roundtrip(current, base, unit)
    if kind == "scale-moves":
        assert not torch.equal(s0, s1)
        assert changed_elements(current, base, unit).numel() >= 1
    if kind == "none":
        assert payload.numel() == HEADER_BYTES


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from([1, 2, 3, 4, 8]), st.integers(0, 300), st.floats(0.0, 1.0)),
                min_size=1, max_size=6), st.integers(0, 2**31 - 1))
def test_many_buffers_compared_at_once_find_what_each_compare_finds(buffers, seed):
    """changed_elements_many (one pass, two read-backs: the GPU's form, forced here) gives
    every buffer's changed_elements, whatever the units (3: rows), sizes and densities."""
    from elastic_refit.kernels.delta import changed_elements_many

    g = torch.Generator().manual_seed(seed)
    currents, bases, units = [], [], []
    for unit, n, density in buffers:
        base = torch.randint(0, 256, (n * unit,), dtype=torch.uint8, generator=g)
        cur = base.clone().view(-1, unit) if n else base.clone().view(0, unit)
        flip = torch.rand(n, generator=g) < density
        cur[flip, 0] ^= 1
        currents.append(cur.reshape(-1))
        bases.append(base)
        units.append(unit)
    found = changed_elements_many(currents, bases, units, batched=True)
    for cur, base, unit, got in zip(currents, bases, units, found, strict=True):
        assert torch.equal(got, changed_elements(cur, base, unit))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([1, 2, 3, 4, 8]), st.lists(st.integers(0, 200), min_size=1, max_size=6),
       st.floats(0.0, 1.0), st.integers(0, 2**31 - 1))
def test_elements_of_many_buffers_gathered_and_written_back(unit, sizes, density, seed):
    """gather_elements_many / write_elements_many (the box codec's reads and writes over all
    of a message's buffers at once; fused on CUDA) equal a read and a write per element."""
    from elastic_refit.kernels.delta import gather_elements_many, write_elements_many

    g = torch.Generator().manual_seed(seed)
    buffers = [torch.randint(0, 256, (n * unit,), dtype=torch.uint8, generator=g) for n in sizes]
    pairs = [(r, i) for r, n in enumerate(sizes) for i in range(n) if torch.rand(1, generator=g).item() < density]
    pairs = [pairs[j] for j in torch.randperm(len(pairs), generator=g).tolist()]  # any order
    ref = torch.tensor([r for r, _ in pairs], dtype=torch.int64)
    index = torch.tensor([i for _, i in pairs], dtype=torch.int64)
    rows = gather_elements_many(buffers, ref, index, unit)
    assert rows.shape == (len(pairs), unit)
    for (r, i), row in zip(pairs, rows, strict=True):
        assert torch.equal(row, buffers[r][i * unit : (i + 1) * unit])
    new = torch.randint(0, 256, (len(pairs), unit), dtype=torch.uint8, generator=g)
    want = [b.clone() for b in buffers]
    for (r, i), row in zip(pairs, new, strict=True):
        want[r][i * unit : (i + 1) * unit] = row
    write_elements_many(buffers, ref, index, new, unit)
    for got, expected in zip(buffers, want, strict=True):
        assert torch.equal(got, expected)
