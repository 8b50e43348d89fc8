"""Plans in a quantized destination format (issue 18 part 2): property tests over random
specs with FP8 destinations, uneven source shards whose boundaries cut blocks, replicated
sources, padded and fused destination buffers. Executing the plan in process reproduces
``kernels.quantize.quantize_reference`` of every whole tensor exactly (FP8 bytes and
scales); each destination domain receives every block once; cross-domain bytes equal the
lower bound in the destination format, computed here independently on dense masks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from elastic_refit.kernels.quantize import NonFiniteBlockError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_refit.layout import LayoutBuilder, TensorFormats, Topology, shard_boxes
from elastic_refit.layout.dtensor import Replicate, Shard
from elastic_refit.layout.formats import DestinationFormat
from elastic_refit.plan import PlanOptions, SourceSide, TransferKind, Uncovered, make_plan
from elastic_refit.plan.quantized import AMAX_ITEMSIZE
from elastic_refit.testing.inprocess import (
    allocate_buffers,
    check_pieces,
    execute_in_process,
    quantize_source_buffers,
    reference_destination,
    scatter_tensors,
)

from .plan_oracle import assert_written_once, write_counts

NUM_RANKS = 8
FORMATS = ("fp8-block16", "fp8-block32", "mxfp8")
SENTINEL = 0xA5


def _bf16_values(shape, seed: int) -> np.ndarray:
    """Finite BF16 values as uint16 storage: normal, some all-zero rows, some tiny values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 6, shape, generator=g).float())
    if len(shape) >= 2 and shape[-2] > 3:
        x[..., 1:3, :] = 0  # zero blocks (scale 1) where whole blocks fall inside
    x.view(-1)[:: 7] *= 1e-30  # tiny values (some flushed to zero as subnormals)
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _cuts(draw, n: int) -> list[int]:
    """Uneven cut points of [0, n): 1-3 parts, boundaries anywhere (they cut blocks)."""
    k = draw(st.integers(1, min(3, n)))
    inner = sorted(draw(st.sets(st.integers(1, n - 1), min_size=k - 1, max_size=k - 1))) if k > 1 else []
    return [0, *inner, n]


@st.composite
def fp8_cases(draw):
    src, dst = LayoutBuilder(), LayoutBuilder()
    formats = {}
    num_tensors = draw(st.integers(1, 2))
    for i in range(num_tensors):
        fmt = DestinationFormat(draw(st.sampled_from(FORMATS)))
        lead = (draw(st.integers(1, 2)),) if draw(st.booleans()) else ()
        shape = (*lead, draw(st.integers(1, 70)), draw(st.integers(1, 70)))
        name = f"layer.{i}.proj.weight"
        formats[name] = fmt
        # Source: an uneven grid of the last two dims, each cell on 1-2 ranks (replicas).
        ts = src.tensor(name, shape, "bfloat16")
        rows, cols = _cuts(draw, shape[-2]), _cuts(draw, shape[-1])
        for r0, r1 in itertools.pairwise(rows):
            for c0, c1 in itertools.pairwise(cols):
                holders = draw(st.lists(st.integers(0, NUM_RANKS - 1), min_size=1, max_size=2, unique=True))
                box = (*lead, r1 - r0, c1 - c0)
                ids = src.buffers(f"{name}@{r0}.{c0}", holders, box, "bfloat16")
                off = np.tile([*(0,) * len(lead), r0, c0], (len(holders), 1))
                src.pieces(ts, ids, off, np.tile(box, (len(holders), 1)), np.zeros_like(off))
        # Destination: DTensor-style shards (uneven chunks), padded buffers.
        td = dst.tensor(name, shape, "bfloat16")
        ndim = len(shape)
        mesh_shape = draw(st.sampled_from([(1,), (2,), (3,), (2, 2), (2, 3), (3, 2), (1, 3)]))
        size = int(np.prod(mesh_shape))
        ranks = np.array(draw(st.permutations(range(NUM_RANKS)))[:size]).reshape(mesh_shape)
        place = tuple(draw(st.one_of(st.just(Replicate()), st.integers(ndim - 2, ndim - 1).map(Shard)))
                      for _ in mesh_shape)
        off, ln = shard_boxes(shape, mesh_shape, place)
        pad_before = np.array([0] * (ndim - 2) + [draw(st.integers(0, 3)) for _ in range(2)])
        pad_after = np.array([draw(st.integers(0, 2)) for _ in range(ndim)])
        ids = dst.buffers(name, ranks.reshape(-1), ln + pad_before + pad_after, "bfloat16")
        dst.pieces(td, ids, off, ln, np.broadcast_to(pad_before, off.shape))
    # A plain tensor rides along in bf16.
    src.tensor("norm.weight", (5,), "bfloat16")
    ids = src.buffers("norm.weight", [0], (5,), "bfloat16")
    src.pieces("norm.weight", ids, [[0]], [[5]], [[0]])
    dst.tensor("norm.weight", (5,), "bfloat16")
    ids = dst.buffers("norm.weight", [NUM_RANKS - 1, 3], (5,), "bfloat16")
    dst.pieces("norm.weight", ids, [[0], [0]], [[5], [5]], [[0], [0]])
    domains = tuple(draw(st.lists(st.integers(0, 3), min_size=NUM_RANKS, max_size=NUM_RANKS)))
    options = PlanOptions(bucket_bytes=draw(st.sampled_from([64, 1 << 20])), relay=draw(st.sampled_from(["off", "on"])))
    return src.build(), dst.build(), Topology(domains), TensorFormats.from_mapping(formats), options


def fp8_lower_bound(src, dst, topology, formats) -> int:
    """Invariant 2 in the destination format, on dense masks: per destination domain, the
    elements it needs and its sources lack (1 byte each for quantized tensors) plus the
    scales of the blocks it needs and no source of it touches."""
    domains = topology.domain_array()
    total = 0
    for t in dst.tensors:
        fmt = formats.of(t.name)
        per_domain: dict[int, list[np.ndarray]] = {}
        grid = fmt.scale_shape(t.shape) if fmt.quantized else ()
        for side, layout in ((0, src), (1, dst)):
            for p in layout.pieces(t.name):
                masks = per_domain.setdefault(int(domains[p.rank]), [np.zeros(t.shape, bool), np.zeros(t.shape, bool),
                                                                      np.zeros(grid, bool), np.zeros(grid, bool)])
                masks[side][p.box.slices()] = True
                if fmt.quantized:
                    o, n = fmt.block_box(p.box.offsets, p.box.lengths)
                    masks[2 + side][tuple(slice(a, a + b) for a, b in zip(o, n, strict=True))] = True
        for s_mask, d_mask, s_blocks, d_blocks in per_domain.values():
            need = int(np.count_nonzero(d_mask & ~s_mask))
            if fmt.quantized:
                total += need + int(np.count_nonzero(d_blocks & ~s_blocks)) * fmt.scale_itemsize
            else:
                total += need * t.itemsize
    return total


def run_fp8_plan(plan, seed: int = 0):
    q = plan.quantization
    tensors = {t.name: _bf16_values(t.shape, seed + i) for i, t in enumerate(q.logical_source.tensors)}
    logical = allocate_buffers(q.logical_source)
    scatter_tensors(q.logical_source, tensors, logical)
    source = quantize_source_buffers(plan, logical)
    destination = allocate_buffers(plan.destination, fill=SENTINEL)
    execute_in_process(plan, source, destination)
    return tensors, destination


@pytest.mark.parametrize("fmt", ["fp8-block16", "mxfp8"])
def test_fp8_plans_of_fused_buffers_reproduce_the_reference_quantizer(fmt):
    """Model presets fuse tensors into one buffer (q, k and v; gate and up), so their scale
    buffers are shared too, and k and v have equal block boxes: each tensor's scales must
    land in its own scale piece."""
    from elastic_refit.layout.presets import checkpoint_formats
    from elastic_refit.layout.refit import model_refit_spec
    from tests.integration.test_executor import TINY_MOE

    spec = model_refit_spec(TINY_MOE, "tp=2,pp=2,ep=2", "tp=2,dp=2")
    plan = make_plan(spec.source, spec.destination, spec.topology, PlanOptions(bucket_bytes=8192),
                     formats=checkpoint_formats(TINY_MOE, fmt))
    fused = {plan.source.buffer_names[int(b)] for b in plan.source.buffer_name}
    assert any("linear_qkv.weight" in n for n in fused) and any("linear_fc1" in n for n in fused), sorted(fused)
    tensors, destination = run_fp8_plan(plan)
    assert check_pieces(plan.destination, reference_destination(plan, tensors), destination) == []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fp8_cases())
def test_fp8_plans_reproduce_the_reference_quantizer(case):
    src, dst, topology, formats, options = case
    plan = make_plan(src, dst, topology, options, formats=formats)
    tensors, destination = run_fp8_plan(plan)
    # every destination byte (FP8 elements and scales) is what the whole-tensor reference holds
    assert check_pieces(plan.destination, reference_destination(plan, tensors), destination) == []
    assert_written_once(plan.destination, write_counts(plan), destination)
    s = plan.stats
    amax_network = plan.quantization.amax.bytes_of(int(TransferKind.NETWORK))
    assert s.cross_domain_bytes == s.lower_bound_bytes
    assert s.lower_bound_bytes == fp8_lower_bound(src, dst, topology, formats) + amax_network
    # only FP8 bytes and scales move for quantized tensors
    t = plan.transfers
    for tid in np.unique(t.tensor).tolist():
        name = plan.destination.tensors[tid].name
        assert plan.destination.tensors[tid].dtype in ("float8_e4m3fn", "float32", "uint8") or name == "norm.weight"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fp8_cases())
def test_each_block_enters_a_domain_once_from_one_quantizing_sender(case):
    src, dst, topology, formats, options = case
    plan = make_plan(src, dst, topology, options, formats=formats)
    domains = topology.domain_array()
    t = plan.transfers
    x = plan.expand(np.flatnonzero(t.kind == int(TransferKind.NETWORK)))
    scale_names = set(plan.quantization.scale_tensor.values())
    seen: dict[tuple, int] = {}
    for i in range(x.row.size):
        row = int(x.row[i])
        tensor = plan.destination.tensors[int(x.tensor[i])]
        if tensor.name not in scale_names:
            continue
        assert t.src_side[row] == int(SourceSide.SOURCE)  # quantized where it is read: by a source rank
        o, n = t.offsets[row, : len(tensor.shape)], t.lengths[row, : len(tensor.shape)]
        for block in np.ndindex(*n.tolist()):
            key = (tensor.name, int(domains[int(t.dst_rank[row])]), tuple(int(a + b) for a, b in zip(o, block, strict=True)))
            seen[key] = seen.get(key, 0) + 1
    assert all(count == 1 for count in seen.values()), {k: v for k, v in seen.items() if v > 1}
    # the exchange carries 4 bytes per block per row, and only between two holders
    amax = plan.quantization.amax
    assert np.array_equal(amax.nbytes[amax.kind != int(TransferKind.LOCAL)],
                          AMAX_ITEMSIZE * np.prod(amax.block_lengths, axis=1)[amax.kind != int(TransferKind.LOCAL)])


def _split_case():
    """One 96 x 80 tensor cut at row 40 on the source (block row 1 split across ranks 0 and
    1, in two domains), columns cut at 48 on the destination (block column 1 shared)."""
    src = LayoutBuilder()
    src.tensor("w", (96, 80), "bfloat16")
    ids = src.buffers("w", [0, 1], [(40, 80), (56, 80)], "bfloat16")
    src.pieces("w", ids, [(0, 0), (40, 0)], [(40, 80), (56, 80)], [(0, 0), (0, 0)])
    dst = LayoutBuilder()
    dst.tensor("w", (96, 80), "bfloat16")
    ids = dst.buffers("w", [2, 3], [(96, 48), (96, 32)], "bfloat16")
    dst.pieces("w", ids, [(0, 0), (0, 48)], [(96, 48), (96, 32)], [(0, 0), (0, 0)])
    return src.build(), dst.build()


def test_split_blocks_exchange_partial_amax_and_count_it():
    src, dst = _split_case()
    topology = Topology((0, 1, 2, 2))
    plan = make_plan(src, dst, topology, formats=TensorFormats.from_mapping({"w": "fp8-block32"}))
    amax = plan.quantization.amax
    # ranks 0 and 1 each get the other's partial amax of block row 1 (3 blocks, float32)
    assert sorted(zip(amax.provider.tolist(), amax.consumer.tolist(), strict=True)) == [(0, 1), (1, 0)]
    assert amax.nbytes.tolist() == [12, 12] and set(amax.kind.tolist()) == {int(TransferKind.NETWORK)}
    assert plan.stats.cross_domain_bytes == plan.stats.lower_bound_bytes == 96 * 80 + 9 * 4 + 24
    assert plan.network_send_bytes[0] >= 12 and plan.network_recv_bytes[1] >= 12
    tensors, destination = run_fp8_plan(plan)
    assert check_pieces(plan.destination, reference_destination(plan, tensors), destination) == []
    # the destination's scale buffers: the blocks each rank's columns touch (rank 3 starts mid-block)
    assert {b.rank: b.shape for b in plan.destination.buffers() if b.name == "w_scale_inv"} == {2: (3, 2), 3: (3, 2)}


def test_without_the_exchange_split_blocks_would_be_wrong():
    """The exchange matters: dropping it changes the scales of the split blocks."""
    import dataclasses

    from elastic_refit.plan.quantized import AmaxExchange

    src, dst = _split_case()
    plan = make_plan(src, dst, Topology((0, 1, 2, 2)), formats=TensorFormats.from_mapping({"w": "fp8-block32"}))
    broken = dataclasses.replace(plan, quantization=dataclasses.replace(plan.quantization,
                                                                        amax=AmaxExchange.empty(plan.source.ndim)))
    tensors, destination = run_fp8_plan(broken)
    assert check_pieces(plan.destination, reference_destination(plan, tensors), destination) != []


def test_bf16_formats_keep_plans_and_fingerprints():
    src, dst = _split_case()
    topology = Topology((0, 1, 2, 2))
    plain = make_plan(src, dst, topology)
    for formats in (TensorFormats(), TensorFormats.from_mapping({"w": "bf16"})):
        same = make_plan(src, dst, topology, formats=formats)
        assert same.fingerprint == plain.fingerprint and same.quantization is None
    fp8 = make_plan(src, dst, topology, formats=TensorFormats.from_mapping({"w": "fp8-block32"}))
    mx = make_plan(src, dst, topology, formats=TensorFormats.from_mapping({"w": "mxfp8"}))
    assert len({plain.fingerprint, fp8.fingerprint, mx.fingerprint}) == 3
    assert fp8.fingerprint == make_plan(src, dst, topology, formats=TensorFormats.from_mapping({"w": "fp8-block32"})).fingerprint
    # mxfp8: 1 x 32 blocks, 1-byte E8M0 codes
    # rows are blocks of their own: the row cut splits none (no exchange); the block column
    # both destination ranks touch (cols 32..63) crosses once
    assert len(mx.quantization.amax) == 0
    assert mx.stats.cross_domain_bytes == mx.stats.lower_bound_bytes == 96 * 80 + 96 * 3
    tensors, destination = run_fp8_plan(mx)
    assert check_pieces(mx.destination, reference_destination(mx, tensors), destination) == []


def test_nonfinite_blocks_are_refused_by_name():
    src, dst = _split_case()
    plan = make_plan(src, dst, Topology((0, 1, 2, 2)), formats=TensorFormats.from_mapping({"w": "fp8-block32"}))
    q = plan.quantization
    values = _bf16_values((96, 80), 0)
    values[50, 7] = 0x7F80  # +Inf in bf16
    logical = allocate_buffers(q.logical_source)
    scatter_tensors(q.logical_source, {"w": values}, logical)
    with pytest.raises(NonFiniteBlockError, match=r"tensor 'w': block \[1, 0\]"):
        quantize_source_buffers(plan, logical)


def test_bad_formats_are_refused_by_name():
    src, dst = _split_case()
    with pytest.raises(ValueError, match="'nope'"):
        make_plan(src, dst, Topology((0, 1, 2, 2)), formats=TensorFormats.from_mapping({"nope": "fp8-block32"}))
    # a source that does not hold the whole of a quantized tensor
    half = LayoutBuilder()
    half.tensor("w", (96, 80), "bfloat16")
    ids = half.buffers("w", [0], [(40, 80)], "bfloat16")
    half.pieces("w", ids, [(0, 0)], [(40, 80)], [(0, 0)])
    only_top = LayoutBuilder()
    only_top.tensor("w", (96, 80), "bfloat16")
    ids = only_top.buffers("w", [2], [(32, 80)], "bfloat16")
    only_top.pieces("w", ids, [(0, 0)], [(32, 80)], [(0, 0)])
    # a source holding the rest may still come (a trainer not joined yet): the version waits
    with pytest.raises(Uncovered, match=r"tensor .w.*whole of every block.*not there yet"):
        make_plan(half.build(), only_top.build(), Topology((0, 1, 2, 2)),
                  formats=TensorFormats.from_mapping({"w": "fp8-block32"}))
    # pieces that overlap never will: a layout fault
    overlapping = LayoutBuilder()
    overlapping.tensor("w", (96, 80), "bfloat16")
    ids = overlapping.buffers("w", [0, 1], [(60, 80), (56, 80)], "bfloat16")
    overlapping.pieces("w", ids, [(0, 0), (40, 0)], [(60, 80), (56, 80)], [(0, 0), (0, 0)])
    with pytest.raises(ValueError, match=r"tensor .w.*overlap") as caught:
        make_plan(overlapping.build(), only_top.build(), Topology((0, 1, 2, 2)),
                  formats=TensorFormats.from_mapping({"w": "fp8-block32"}))
    assert not isinstance(caught.value, Uncovered)


def test_rank_views_of_the_fp8_layouts_are_slices_of_the_plan():
    """``plan --rank`` plans one rank's rows on the FP8 layouts (``format_layouts``): the same
    rows as the full plan's (the exchange is the full plan's alone)."""
    from elastic_refit.plan import format_layouts, make_rank_plan

    src, dst = _split_case()
    topology = Topology((0, 1, 2, 2))
    formats = TensorFormats.from_mapping({"w": "fp8-block32"})
    options = PlanOptions(relay="off")  # per-rank plans do not relay
    plan = make_plan(src, dst, topology, options, formats=formats)
    qsrc, qdst, _ = format_layouts(src, dst, formats)
    for rank in range(4):
        view = make_rank_plan(qsrc, qdst, topology, options, rank=rank)
        rows = plan.rows_for(rank)
        assert len(view.transfers) == rows.size
        assert np.array_equal(view.transfers.nbytes, plan.transfers.nbytes[rows])
