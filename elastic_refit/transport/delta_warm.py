"""A delta refit's kernels loaded before the first delta refit needs them (GPU).

CUDA loads a kernel at its first launch, and a delta refit launches a few dozen that a full
refit never does (the box codec's searches, scans, index arithmetic and digest moves, the
fused gathers and scatters). On an H100 with 8 ranks under MPS a member's first delta refit
took 0.74-0.83 s against 0.04-0.06 s for the next ones, with the Triton kernels already
compiled (``kernels.delta_triton.warm_up``). :func:`warm_up` runs the codec once on a tiny
geometry instead; :meth:`Executor.warm` calls it when its refits may carry deltas.
"""

from __future__ import annotations

import torch

from elastic_refit.layout import Buffer
from elastic_refit.transport.delta_boxes import Boxes
from elastic_refit.transport.schedule import BoxCopy, RankSchedule

__all__ = ["warm_up"]

_SHAPE = (8, 64)
_warmed: set[torch.device] = set()


def warm_up(device: torch.device | str) -> int:
    """Code, check and write a delta with the vectorized box codec on ``device`` (once per
    process and device): a 2-D buffer whole and half its columns, 2- and 4-byte elements,
    every result checked. Returns the geometries run: 0 on a CPU (its compiled codec needs
    no warming) or when this device was warmed before. Raises ``RuntimeError`` if the codec
    gives a wrong byte here."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # one key per GPU, however it is named
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu" or device in _warmed:
        return 0
    runs = exercise(device)
    _warmed.add(device)
    return runs


def exercise(device: torch.device, *, vectorized: bool | None = None) -> int:
    """The codec run of :func:`warm_up` (any device; ``vectorized`` as :class:`Boxes`)."""
    runs = 0
    g = torch.Generator().manual_seed(7)
    for dtype, ints, floats in (("bfloat16", torch.int16, torch.bfloat16), ("float32", torch.int32, torch.float32)):
        ref = (0, "warm-up")
        schedule = RankSchedule(rank=0, fingerprint="warm-up", local_copies=(), steps=(), max_bucket_bytes=0,
                                buffers={ref: Buffer(rank=0, name="warm-up", shape=_SHAPE, dtype=dtype)})
        base = torch.randint(-1000, 1000, _SHAPE, generator=g, dtype=torch.int64).to(ints)
        cur = base.clone()
        cur[torch.rand(_SHAPE, generator=g) < 0.1] += 1
        base, cur = base.to(device), cur.to(device)
        itemsize = base.element_size()
        rows, cols = _SHAPE
        for offsets, lengths in (((0, 0), _SHAPE), ((0, cols // 2), (rows, cols // 2))):
            box = BoxCopy(ref, offsets, lengths, 0, rows * lengths[1] * itemsize)
            boxes = Boxes((box,), schedule, device, vectorized=vectorized)
            # The buffers in their own dtype, as a refit hands them; compared as integers.
            seg = boxes.segments({ref: cur.view(floats)}, {ref: base.view(floats)}, True)
            target = base.clone()
            moves, written = boxes.apply_segments({ref: target.view(floats)}, seg, True)
            ok = torch.equal(moves.cpu(), seg.moves.cpu())
            written.finish(ok)
            region = (slice(None), slice(offsets[1], offsets[1] + lengths[1]))
            if not (ok and torch.equal(target[region], cur[region])):
                raise RuntimeError(f"the delta codec gave wrong bytes on {device} ({dtype}, box {lengths}): "
                                   "deltas cannot be trusted on this device")
            runs += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return runs
