"""A sender's side of a quantized plan: its BF16 source pieces into FP8 and scale staging.

Plans in a quantized destination format (``Plan.quantization``): the caller passes its BF16
source buffers and the destination's FP8 ``weight`` and scale (``weight_scale_inv``) buffers
(``plan.destination``'s). Before its first message a sender quantizes every source piece it
sends from (:class:`SourceQuantizer`) into FP8 and scale staging of the epoch (one uint8
arena), after the plan's partial-amax exchange for blocks split across source shards (one
batch of small messages). Pieces whose blocks are whole go through the fused Triton kernel
(``QuantPackProgram``, built once per epoch: one launch per group of boxes, writing straight
into the staging; ``pack_backend`` "triton", or "auto" on CUDA with Triton installed);
pieces with split blocks, and every piece with ``pack_backend="torch"``, through the
reference quantizer's plain torch ops (``elastic_refit.kernels.quantize``) with the combined
amax. Both give the same bytes. The plan's rows then move FP8 bytes and scales like any
others, and the receiver's unpack places them into its weight and scale buffers. Digests
(``verify``) are of those FP8 bytes and scales, taken on the quantizing sender. A block with
NaN or Inf fails the refit on its sender (``NonFiniteBlockError`` naming the tensor and block).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from elastic_refit.kernels import QuantPackProgram, QuantRegion
from elastic_refit.plan import Plan, SourceSide
from elastic_refit.transport.protocol import P2POp, Transport

__all__ = ["AMAX_TAG", "SourceQuantizer"]

# Partial-amax messages of quantized plans: this plus the exchange row (same on both ends);
# distinct from the executor's bucket and forward tags.
AMAX_TAG = 1 << 22


class SourceQuantizer:
    """A sender's side of a quantized plan: the source pieces this rank sends from (element or
    scale rows), quantized into FP8 and scale staging kept for the epoch, after the plan's
    partial-amax exchange (``elastic_refit.plan.quantized``). ``run`` maps the caller's BF16
    source buffers to the buffers ``plan.source`` declares (FP8 and scales)."""

    def __init__(self, plan: Plan, rank: int, device: torch.device, backend: str = "auto") -> None:
        q = plan.quantization
        src = plan.source
        self.rank, self.device, self.q = rank, device, q
        t = plan.transfers
        rows = np.flatnonzero((t.src_rank == rank) & (t.src_side == int(SourceSide.SOURCE)))
        sending = set(plan.expand(rows).src_piece.tolist()) if rows.size else set()
        quantized = {src.tensor_index(n): q.format_of(n) for n in q.scale_tensor if n in src._tensor_index}
        scale_ids = {src.tensor_index(q.scale_tensor[src.tensors[tid].name]) for tid in quantized}
        mine = np.flatnonzero(src.piece_rank == rank)
        # A scale piece by its tensor, buffer and block box: tensors fused in one buffer (q, k
        # and v; gate and up) share a scale buffer, and equal shapes give equal block boxes.
        scale_piece = {}
        for p in mine.tolist():
            if int(src.piece_tensor[p]) in scale_ids:
                nd = len(src.tensors[int(src.piece_tensor[p])].shape)
                scale_piece[(int(src.piece_tensor[p]), self._buffer(src, p), tuple(src.piece_offsets[p, :nd].tolist()),
                             tuple(src.piece_lengths[p, :nd].tolist()))] = p
        self.work = []  # (piece, fmt, name, (buffer, local slices, lengths), scale piece's | None, block offsets)
        self.buffers: dict[str, tuple[str, tuple[int, ...], torch.dtype]] = {}
        for p in mine.tolist():
            tid = int(src.piece_tensor[p])
            fmt = quantized.get(tid)
            if fmt is None:
                continue
            nd = len(src.tensors[tid].shape)
            b_off, b_len = fmt.block_box(src.piece_offsets[p, :nd].tolist(), src.piece_lengths[p, :nd].tolist())
            name = self._buffer(src, p)
            s_piece = scale_piece.get((src.tensor_index(q.scale_tensor[src.tensors[tid].name]), name + fmt.scale_suffix,
                                       b_off, b_len))
            b = int(src.piece_buffer[p])
            self.buffers[name] = (q.logical_source.tensor(src.tensors[tid].name).dtype,
                                  tuple(int(v) for v in src.buffer_shape[b, : int(src.buffer_ndim[b])]),
                                  torch.float8_e4m3fn)
            if s_piece is not None:
                sb = int(src.piece_buffer[s_piece])
                self.buffers[name + fmt.scale_suffix] = (
                    "", tuple(int(v) for v in src.buffer_shape[sb, : int(src.buffer_ndim[sb])]),
                    getattr(torch, fmt.scale_dtype))
            if p not in sending and s_piece not in sending:
                continue
            self.work.append((p, fmt, src.tensors[tid].name, self._local(src, p, nd),
                              None if s_piece is None else self._local(src, s_piece, nd), b_off))
        amax = q.amax
        self.sends = [i for i in range(len(amax)) if amax.provider[i] == rank and amax.kind[i] != 0]
        self.recvs = [i for i in range(len(amax)) if amax.consumer[i] == rank and amax.kind[i] != 0]
        self.by_consumer: dict[int, list[int]] = {}
        for i in range(len(amax)):
            if amax.consumer[i] == rank:
                self.by_consumer.setdefault(int(amax.consumer_piece[i]), []).append(i)
        self.src = src
        # One arena holds every staging buffer (64-byte aligned), so the fused kernel writes
        # FP8 bytes and scales straight into them: they are views of its one bucket.
        self._arena_offset: dict[str, int] = {}
        self.arena_bytes = 0
        for name, (_dtype, shape, stage_dtype) in self.buffers.items():
            self._arena_offset[name] = self.arena_bytes
            self.arena_bytes += _aligned64(int(np.prod(shape)) * stage_dtype.itemsize)
        self._arena: torch.Tensor | None = None
        self._staging: dict[str, torch.Tensor] = {}
        # Per work item: the parts of its block grid the torch path quantizes (block slices of
        # the last two dims; the split blocks at its edges, or all of it), and the programs
        # of the fused kernel for the whole blocks inside (one per format, over the arena).
        self.grids = [self._grid(w[0]) for w in self.work]
        self.parts, self.programs = self._partition(backend)

    @property
    def num_fused_regions(self) -> int:
        """Boxes of whole blocks the fused kernel quantizes per run."""
        return sum(len(program.regions) for program, _ in self.programs)

    def _partition(self, backend: str) -> tuple[list[tuple[tuple[slice, slice], ...]],
                                                 tuple[tuple[QuantPackProgram, tuple[str, ...]], ...]]:
        """Cut every work item into the torch path's parts and the fused kernel's box: with
        the fused kernel (``backend`` "triton", or "auto" on CUDA with Triton), the blocks
        of a piece of a BF16 buffer that lie whole inside it go to one region of the
        format's program, writing strided into the staging; its edge blocks that other
        shards share (split blocks) stay parts, quantized after the exchange."""
        use_kernel = backend == "triton" or (backend == "auto" and self.device.type == "cuda" and _have_triton())
        by_format: dict[str, tuple[object, list[str], list[QuantRegion]]] = {}
        parts: list[tuple[tuple[slice, slice], ...]] = []
        for (p, fmt, _name, (buffer, slices, lengths), scale_at, _b_off), grid in zip(self.work, self.grids, strict=True):
            nd = len(lengths)
            whole = (slice(0, grid[-2]), slice(0, grid[-1]))
            inner = self._whole_blocks(p) if use_kernel and scale_at is not None else None
            if inner is not None and self.buffers[buffer][0] == "bfloat16" \
                    and tuple(sl.stop - sl.start for sl in scale_at[1])[-2:] == grid[-2:]:
                (a, b), (c, d) = inner
                parts.append(tuple(part for part in (
                    (slice(0, a), whole[1]), (slice(b, grid[-2]), whole[1]),
                    (slice(a, b), slice(0, c)), (slice(a, b), slice(d, grid[-1])),
                ) if part[0].stop > part[0].start and part[1].stop > part[1].start))
                rows_cols, _ = self._elements(p, (*_all_lead(nd), slice(a, b), slice(c, d)))
                offsets = (*(sl.start for sl in slices[:-2]), *(sl.start + e.start for sl, e in zip(slices[-2:], rows_cols[-2:], strict=True)))
                box = (*(sl.stop - sl.start for sl in slices[:-2]), *(e.stop - e.start for e in rows_cols[-2:]))
                s_buffer, s_slices, _ = scale_at
                s_offsets = (*(sl.start for sl in s_slices[:-2]), s_slices[-2].start + a, s_slices[-1].start + c)
                d_str, s_str = _dense_strides(self.buffers[buffer][1]), _dense_strides(self.buffers[s_buffer][1])
                _, names, regions = by_format.setdefault(fmt.name, (fmt, [], []))
                if buffer not in names:
                    names.append(buffer)
                itemsize = getattr(torch, fmt.scale_dtype).itemsize
                regions.append(QuantRegion(
                    names.index(buffer), offsets, box,
                    self._arena_offset[buffer] + sum(o * st for o, st in zip(offsets, d_str, strict=True)),
                    self._arena_offset[s_buffer] + itemsize * sum(o * st for o, st in zip(s_offsets, s_str, strict=True)),
                    data_strides=d_str, scale_strides=s_str))
            else:
                parts.append((whole,))
        programs = tuple(
            (QuantPackProgram([self.buffers[n][1] for n in names], regions, fmt, device=self.device, backend="triton",
                              names=names), tuple(names))
            for fmt, names, regions in by_format.values())
        return parts, programs

    def _grid(self, p: int) -> tuple[int, ...]:
        """Piece ``p``'s block grid (lead dims in elements)."""
        src = self.src
        tid = int(src.piece_tensor[p])
        nd = len(src.tensors[tid].shape)
        fmt = self.q.format_of(src.tensors[tid].name)
        return tuple(fmt.block_box(src.piece_offsets[p, :nd].tolist(), src.piece_lengths[p, :nd].tolist())[1])

    def _whole_blocks(self, p: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """Block rows and columns ``[a, b) x [c, d)`` of piece ``p``'s grid that lie whole in
        it (clipped only by the tensor's edge), or None when there are none."""
        src = self.src
        tid = int(src.piece_tensor[p])
        shape = src.tensors[tid].shape
        nd = len(shape)
        fmt = self.q.format_of(src.tensors[tid].name)
        grid = self._grid(p)
        out = []
        for k, b in zip((nd - 2, nd - 1), fmt.block_shape, strict=True):
            lo, n = int(src.piece_offsets[p, k]), int(src.piece_lengths[p, k])
            first = 1 if lo % b else 0
            last = grid[k] - (1 if (lo + n) % b and lo + n != shape[k] else 0)
            if last <= first:
                return None
            out.append((first, last))
        return out[0], out[1]

    def _elements(self, p: int, at: tuple[slice, ...]) -> tuple[tuple[slice, ...], tuple[int, int]]:
        """The element slices of piece ``p`` (its own coordinates) inside the blocks ``at``
        of its grid (lead dims in elements, ``slice(None)``: all), and where they start
        inside their first block."""
        src = self.src
        tid = int(src.piece_tensor[p])
        nd = len(src.tensors[tid].shape)
        fmt = self.q.format_of(src.tensors[tid].name)
        out, origin = list(at[:-2]), []
        for k, b, blocks in zip((nd - 2, nd - 1), fmt.block_shape, at[-2:], strict=True):
            lo, n = int(src.piece_offsets[p, k]), int(src.piece_lengths[p, k])
            first = lo // b
            start, stop = max(lo, (first + blocks.start) * b), min(lo + n, (first + blocks.stop) * b)
            out.append(slice(start - lo, stop - lo))
            origin.append(start % b)
        return tuple(out), (origin[0], origin[1])

    def _amax(self, source, p: int, at: tuple[slice, ...]) -> torch.Tensor:
        """Block amax of piece ``p``'s elements inside the blocks ``at`` of its grid."""
        from elastic_refit.kernels.quantize import block_amax

        elements, origin = self._elements(p, at)
        return block_amax(self._piece(source, p)[elements], self.q.format_of(self._name(p)), origin)

    def _name(self, p: int) -> str:
        return self.src.tensors[int(self.src.piece_tensor[p])].name

    @staticmethod
    def _buffer(layout, p: int) -> str:
        return layout.buffer_names[int(layout.buffer_name[int(layout.piece_buffer[p])])]

    @staticmethod
    def _local(layout, p: int, nd: int) -> tuple[str, tuple[slice, ...], tuple[int, ...]]:
        """(buffer, local slices, global lengths) of piece ``p``."""
        bnd = int(layout.buffer_ndim[int(layout.piece_buffer[p])])
        off, ln = layout.piece_local_offsets[p, :bnd], layout.piece_local_lengths[p, :bnd]
        return (SourceQuantizer._buffer(layout, p), tuple(slice(int(o), int(o + n)) for o, n in zip(off, ln, strict=True)),
                tuple(int(v) for v in layout.piece_lengths[p, :nd]))

    def _piece(self, source: Mapping[str, torch.Tensor], p: int) -> torch.Tensor:
        nd = len(self.src.tensors[int(self.src.piece_tensor[p])].shape)
        name, slices, lengths = self._local(self.src, p, nd)
        if name not in source:
            raise ValueError(f"rank {self.rank}: source buffer {name!r} is missing")
        return source[name][slices].reshape(lengths)

    def _exchange_slices(self, i: int, p: int) -> tuple[slice, ...]:
        """Where exchange row ``i``'s blocks sit in piece ``p``'s block grid."""
        src, amax = self.src, self.q.amax
        tid = int(src.piece_tensor[p])
        fmt = self.q.format_of(src.tensors[tid].name)
        nd = len(src.tensors[tid].shape)
        b_off, _ = fmt.block_box(src.piece_offsets[p, :nd].tolist(), src.piece_lengths[p, :nd].tolist())
        lo, ln = amax.block_offsets[i, :nd], amax.block_lengths[i, :nd]
        return tuple(slice(int(a - b), int(a - b + n)) for a, b, n in zip(lo, b_off, ln, strict=True))

    def _partial(self, source, i: int, p: int) -> torch.Tensor:
        """The partial amax of piece ``p`` over exchange row ``i``'s blocks."""
        return self._amax(source, p, self._exchange_slices(i, p)).contiguous()

    def run(self, source: Mapping[str, torch.Tensor], transport: Transport) -> dict[str, torch.Tensor]:
        """The buffers ``plan.source`` declares for this rank: the caller's ``source``
        buffers that are not quantized, as given, and the FP8 and scale staging of the
        quantized ones, holding every piece this rank sends from (quantized after the
        partial-amax exchange over ``transport``). ``ValueError`` for a missing or
        mismatched source buffer; ``NonFiniteBlockError`` for a block with NaN or Inf."""
        out = self._staged(source)
        received = self._exchange_amax(source, transport)
        for program, names in self.programs:  # whole blocks: one launch per group, into the arena
            missing = [n for n in names if n not in source]
            if missing:
                raise ValueError(f"rank {self.rank}: source buffer {missing[0]!r} is missing")
            program.pack([source[n].contiguous() for n in names], self._arena)
        self._quantize_parts(source, out, received)
        self._check_staged(out)
        return out

    @property
    def arena(self) -> torch.Tensor | None:
        """Every staging buffer of the last run, in one tensor (None before the first)."""
        return self._arena

    def views(self, arena: torch.Tensor) -> dict[str, torch.Tensor]:
        """The staging buffers, by name, as views of ``arena`` (a copy of :attr:`arena`):
        what a run quantized, kept (deltas compare the next version's with it)."""
        out = {}
        for name, (_dtype, shape, stage_dtype) in self.buffers.items():
            at, nbytes = self._arena_offset[name], int(np.prod(shape)) * stage_dtype.itemsize
            out[name] = arena[at : at + nbytes].view(stage_dtype).reshape(shape)
        return out

    def _staged(self, source: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``source`` with every quantized buffer replaced by its staging (a view of the
        arena, made on the first run and kept for the epoch)."""
        out = {n: t for n, t in source.items() if n not in self.buffers}
        if self._arena is None:
            self._arena = torch.zeros(self.arena_bytes, dtype=torch.uint8, device=self.device)
        for name, (dtype, shape, stage_dtype) in self.buffers.items():
            if dtype and name in source and (source[name].dtype != getattr(torch, dtype) or tuple(source[name].shape) != shape):
                raise ValueError(f"rank {self.rank}: source buffer {name!r} is {list(source[name].shape)} "
                                 f"{source[name].dtype}, the layout says {list(shape)} {dtype}")
            staged = self._staging.get(name)
            if staged is None:
                at = self._arena_offset[name]
                nbytes = int(np.prod(shape)) * stage_dtype.itemsize
                staged = self._staging[name] = self._arena[at : at + nbytes].view(stage_dtype).reshape(shape)
            out[name] = staged
        return out

    def _exchange_amax(self, source: Mapping[str, torch.Tensor], transport: Transport) -> dict[int, torch.Tensor]:
        """The partial-amax exchange: one batch of small messages, before any piece is
        quantized. Returns what arrived, by exchange row."""
        amax = self.q.amax
        received: dict[int, torch.Tensor] = {}
        ops, waits = [], []
        for i in self.sends:
            payload = self._partial(source, i, int(amax.provider_piece[i]))
            ops.append(P2POp("send", payload.view(torch.uint8).reshape(-1), int(amax.consumer[i]), AMAX_TAG + i))
            waits.append((int(amax.consumer[i]), "send partial amax"))
        for i in self.recvs:
            nd = len(self.src.tensors[int(amax.tensor[i])].shape)
            buf = torch.empty(tuple(int(v) for v in amax.block_lengths[i, :nd]), dtype=torch.float32, device=self.device)
            received[i] = buf
            ops.append(P2POp("recv", buf.view(torch.uint8).reshape(-1), int(amax.provider[i]), AMAX_TAG + i))
            waits.append((int(amax.provider[i]), "receive partial amax"))
        if ops:
            for work, (peer, what) in zip(transport.post(ops), waits, strict=True):
                transport.wait(work, peer, what)
        return received

    def _quantize_parts(self, source: Mapping[str, torch.Tensor], out: dict[str, torch.Tensor],
                        received: dict[int, torch.Tensor]) -> None:
        """The torch path: every part the fused kernel does not take (split blocks, or all
        of a piece), quantized with the amax its blocks have over every source shard."""
        from elastic_refit.kernels.quantize import (
            check_scales,
            quantize_with_scales,
            scales_from_amax,
        )

        for (p, fmt, name, (buffer, slices, lengths), scale_at, b_off), parts in zip(self.work, self.parts, strict=True):
            if not parts:  # all of it in the fused kernel
                continue
            x = self._piece(source, p)
            lead = _all_lead(len(lengths))
            for rows, cols in parts:
                at = (*lead, rows, cols)
                full = (*(slice(0, n) for n in lengths[:-2]), rows, cols)  # the part in the piece's grid
                scales = scales_from_amax(self._combined_amax(source, p, at, full, received), fmt)
                elements, origin = self._elements(p, at)
                if scale_at is None:  # nothing stages these scales: check them here
                    check_scales(scales, fmt, name, tuple(o + s.start for o, s in zip(b_off, full, strict=True)))
                region = out[buffer][slices][(..., *elements[-2:])]
                region.copy_(quantize_with_scales(x[elements], scales, fmt, origin).reshape(region.shape))
                if scale_at is not None:
                    s_buffer, s_slices, _ = scale_at
                    region = out[s_buffer][s_slices][..., rows, cols]
                    region.copy_(scales.reshape(region.shape))

    def _combined_amax(self, source: Mapping[str, torch.Tensor], p: int, at: tuple[slice, ...],
                       full: tuple[slice, ...], received: dict[int, torch.Tensor]) -> torch.Tensor:
        """Block amax of piece ``p``'s part ``at`` (``full``: the part in the piece's grid),
        combined with the partial amax other shards have of the blocks it shares with them
        (received, or this rank's own when it provides that row too)."""
        from elastic_refit.kernels.quantize import combine_amax

        amax = self.q.amax
        blocks = self._amax(source, p, at)
        for i in self.by_consumer.get(p, []):
            # The row's blocks that fall in this part, in both grids.
            ex = self._exchange_slices(i, p)
            lo = [max(f.start, e.start) for f, e in zip(full, ex, strict=True)]
            hi = [min(f.stop, e.stop) for f, e in zip(full, ex, strict=True)]
            if any(h <= low for low, h in zip(lo, hi, strict=True)):
                continue
            mine = tuple(slice(low - f.start, h - f.start) for low, h, f in zip(lo, hi, full, strict=True))
            theirs = tuple(slice(low - e.start, h - e.start) for low, h, e in zip(lo, hi, ex, strict=True))
            partial = received[i] if i in received else self._partial(source, i, int(amax.provider_piece[i]))
            blocks[mine] = combine_amax(blocks[mine], partial[theirs])
        return blocks

    def _check_staged(self, out: dict[str, torch.Tensor]) -> None:
        """Every staged piece's scales, as the torch path always checked them (the first
        poisoned block of the first poisoned piece in ``work`` is named, whichever path
        wrote it); one sync when none is."""
        from elastic_refit.kernels.quantize import check_scales, poisoned

        staged = [(w, out[w[4][0]][w[4][1]].reshape(grid)) for w, grid in zip(self.work, self.grids, strict=True)
                  if w[4] is not None]
        if staged and bool(torch.stack([poisoned(v, w[1]).any() for w, v in staged]).any()):
            for (_p, fmt, name, _local, _scale_at, b_off), v in staged:
                check_scales(v, fmt, name, b_off)


def _aligned64(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def _dense_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(torch.empty(shape, device="meta").stride())


def _all_lead(nd: int) -> tuple[slice, ...]:
    """Every index of a box's leading dims (all but the last two)."""
    return (slice(None),) * (nd - 2)


def _have_triton() -> bool:
    from elastic_refit.kernels import _triton_backend

    return _triton_backend.HAVE_TRITON

