"""Where a message's boxes sit (``transport.delta._Boxes``): for random buffers and boxes
(any dims, partial anywhere, several buffers and element sizes), the changed elements of
the buffers that fall in each box, and their indices there, are exactly what packing the
box would give, and the way back lands on the same elements."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_refit.transport.delta_boxes import Boxes as _Boxes
from elastic_refit.transport.schedule import BoxCopy

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def message(draw):
    buffers, boxes = {}, []
    for i in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
        ref = (0, f"b{i}")
        buffers[ref] = SimpleNamespace(shape=shape, dtype=draw(st.sampled_from(["bfloat16", "float32", "uint8"])))
        for _ in range(draw(st.integers(1, 3))):
            offsets, lengths = [], []
            for n in shape:
                o = draw(st.integers(0, n - 1))
                offsets.append(o)
                lengths.append(draw(st.integers(1, n - o)))
            boxes.append(BoxCopy(ref, tuple(offsets), tuple(lengths), 0, 0))
    order = draw(st.permutations(range(len(boxes))))
    density = draw(st.floats(0.0, 1.0))
    seed = draw(st.integers(0, 2**31 - 1))
    return buffers, tuple(boxes[i] for i in order), density, seed


@SETTINGS
@given(message())
def test_select_and_flat_agree_with_packing(case):
    buffers, boxes, density, seed = case
    g = torch.Generator().manual_seed(seed)
    geometry = _Boxes(boxes, SimpleNamespace(buffers=buffers), torch.device("cpu"))
    changed = {}
    for ref, b in buffers.items():
        numel = 1
        for n in b.shape:
            numel *= n
        changed[ref] = (torch.rand(numel, generator=g) < density).nonzero().flatten()
    local, flat, box = geometry.select([changed[r] for r in geometry.refs])
    for i, b in enumerate(boxes):
        shape = buffers[b.buffer].shape
        index = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
        region = index[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths, strict=True))].reshape(-1)
        mask = torch.zeros(int(torch.tensor(shape).prod()), dtype=torch.bool)
        mask[changed[b.buffer]] = True
        want_local = mask[region].nonzero().flatten()
        mine = box == i
        assert torch.equal(local[mine], want_local), (b, local[mine], want_local)
        assert torch.equal(flat[mine], region[want_local])
    assert torch.equal(geometry.flat(local, box), flat)
    # stream order: box after box
    assert bool((box[1:] >= box[:-1]).all()) if box.numel() > 1 else True


@SETTINGS
@given(message(), st.booleans())
def test_both_forms_code_and_apply_the_same_change(case, verify):
    """The numpy views (CPU) and the vectorized form (any device) code the same change
    from a base, and applying it to the base gives the buffers exactly, with the same
    digest moves as the sender's."""
    buffers, boxes, density, seed = case
    boxes = tuple(b for i, b in enumerate(boxes) if all(  # one box per element: disjoint regions
        not _overlap(b, c) for c in boxes[:i]))
    g = torch.Generator().manual_seed(seed)
    base, current = {}, {}
    for ref, b in buffers.items():
        dtype = getattr(torch, b.dtype)
        raw = torch.randint(0, 256, (*b.shape, torch.empty(0, dtype=dtype).element_size()), dtype=torch.uint8,
                            generator=g)
        base[ref] = raw.view(dtype).reshape(b.shape)
        flip = torch.rand(raw.shape[:-1], generator=g) < density
        changed = raw.clone()
        changed[..., 0][flip] ^= 0x5A
        current[ref] = changed.view(dtype).reshape(b.shape)
    schedule = SimpleNamespace(buffers=buffers)
    numpy_form = _Boxes(boxes, schedule, torch.device("cpu"))
    torch_form = _Boxes(boxes, schedule, torch.device("cpu"), vectorized=True)
    a = numpy_form.code(current, base, {}, verify)
    b = torch_form.code(current, base, {}, verify)
    for field in ("local", "counts", "values", "moves"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    for form in (numpy_form, torch_form):
        target = {ref: t.clone() for ref, t in base.items()}
        moves, write = form.apply(target, a, verify)
        if verify:
            assert torch.equal(moves, a.moves)
        write()
        for ref, t in target.items():
            want = base[ref].clone()
            for box in boxes:
                if box.buffer == ref:
                    region = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))
                    want[region] = current[ref][region]
            assert torch.equal(t.view(torch.uint8), want.view(torch.uint8)), ref


def _overlap(a: BoxCopy, b: BoxCopy) -> bool:
    return a.buffer == b.buffer and all(
        oa < ob + nb and ob < oa + na for oa, na, ob, nb in zip(a.offsets, a.lengths, b.offsets, b.lengths, strict=True))


@SETTINGS
@given(message(), st.booleans(), st.booleans())
def test_segments_agree_in_every_form(case, verify, native):
    """Segments (each box's entries then values) from the compiled form, numpy's and the
    vectorized tensor form are the same bytes, and applying them gives the buffers."""
    import elastic_refit.transport.delta_boxes as delta_boxes

    buffers, boxes, density, seed = case
    boxes = tuple(b for i, b in enumerate(boxes) if all(not _overlap(b, c) for c in boxes[:i]))
    g = torch.Generator().manual_seed(seed)
    base, current = {}, {}
    for ref, b in buffers.items():
        dtype = getattr(torch, b.dtype)
        raw = torch.randint(0, 256, (*b.shape, torch.empty(0, dtype=dtype).element_size()), dtype=torch.uint8,
                            generator=g)
        base[ref] = raw.view(dtype).reshape(b.shape)
        changed = raw.clone()
        changed[..., -1][torch.rand(raw.shape[:-1], generator=g) < density] ^= 0x21
        current[ref] = changed.view(dtype).reshape(b.shape)
    schedule = SimpleNamespace(buffers=buffers)
    saved = delta_boxes._native
    try:
        if not native:
            delta_boxes._native = None
        cpu = _Boxes(boxes, schedule, torch.device("cpu"))
        vec = _Boxes(boxes, schedule, torch.device("cpu"), vectorized=True)
        a, b = cpu.segments(current, base, verify), vec.segments(current, base, verify)
        for field in ("entries", "value_bytes", "coded") + (("moves",) if verify else ()):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        for form in (cpu, vec):
            target = {ref: t.clone() for ref, t in base.items()}
            moves, written = form.apply_segments(target, a, verify)
            if verify:
                assert torch.equal(moves, a.moves)
            written.finish(True)
            for ref, t in target.items():
                want = base[ref].clone()
                for box in boxes:
                    if box.buffer == ref:
                        region = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))
                        want[region] = current[ref][region]
                assert torch.equal(t.view(torch.uint8), want.view(torch.uint8)), ref
    finally:
        delta_boxes._native = saved


@pytest.mark.parametrize("native", [True, False])
def test_a_failed_check_leaves_the_buffers_as_they_were(native):
    """Applying segments and finding their digest moves wrong writes nothing that stays:
    the compiled form writes in one pass and puts the old elements back."""
    import elastic_refit.transport.delta_boxes as delta_boxes

    ref = (0, "w")
    buffers = {ref: SimpleNamespace(shape=(64, 32), dtype="bfloat16")}
    box = BoxCopy(ref, (0, 8), (64, 16), 0, 64 * 16 * 2)
    base = {ref: torch.randn(64, 32).to(torch.bfloat16)}
    current = {ref: base[ref].clone()}
    current[ref][::3, 9] += 1
    saved = delta_boxes._native
    try:
        if not native:
            delta_boxes._native = None
        form = _Boxes((box,), SimpleNamespace(buffers=buffers), torch.device("cpu"))
        seg = form.segments(current, base, True)
        target = {ref: base[ref].clone()}
        _moves, written = form.apply_segments(target, seg, True)
        written.finish(False)
        assert torch.equal(target[ref].view(torch.int16), base[ref].view(torch.int16))
    finally:
        delta_boxes._native = saved


def test_the_received_messages_delta_headers_are_checked_together_and_the_first_bad_one_is_named():
    """A receiver keeps each arrived delta header (a device copy) and checks those of every
    message it received at once: one read back in all, not one per bucket or message."""
    from elastic_refit.errors import VerificationFailed
    from elastic_refit.transport.delta_round import _Message, check_headers

    def header(entries: int, values: int) -> torch.Tensor:
        return torch.tensor([entries, values], dtype=torch.int64).view(torch.uint8).clone()

    def message(headers) -> _Message:
        empty = torch.zeros(0, dtype=torch.int64)
        return _Message(empty, empty, empty.view(torch.uint8), empty, [], headers=headers)

    check_headers([])
    check_headers([(message([]), "rank 4 round 0")])
    check_headers([(message([(header(3, 12), (3, 12)), (header(0, 0), (0, 0))]), "rank 4 round 0")])
    good = message([(header(3, 12), (3, 12))])
    with pytest.raises(VerificationFailed, match=r"rank 4 round 1: the header of its delta bucket 1 says \(5, 12\), "
                                                 r"its sizes said \(3, 12\)"):
        check_headers([(good, "rank 4 round 0"), (message([(header(3, 12), (3, 12)), (header(5, 12), (3, 12)),
                                                            (header(9, 9), (1, 1))]), "rank 4 round 1")])
