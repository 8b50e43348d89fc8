"""Buckets bound to one rank's tensors: how the executor packs, sends, receives and unpacks.

A :class:`BucketIO` is one bucket of a message (pack into staging and unpack from it with one
kernel launch, or a direct view of the parameter when the bucket is one contiguous box; with
verification on, a digest trailer per box after the data). A source buffer that the plan
casts (``RankSchedule.wire_dtypes``) is cast as it is packed, never sent as a direct view. A :class:`ForwardIn` is a needer's
side of one forward part of a relayed plan (where each span lands, and the digests the
relay passed on).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from elastic_refit.errors import VerificationFailed
from elastic_refit.kernels import BoxRegion, PackProgram
from elastic_refit.kernels import digests as fused_digests
from elastic_refit.layout import DTYPE_ITEMSIZE
from elastic_refit.transport.buffers import byte_view, digest
from elastic_refit.transport.options import ExecutorOptions
from elastic_refit.transport.schedule import (
    STAGED,
    BoxCopy,
    Bucket,
    BufferRef,
    ForwardPart,
    RankSchedule,
)

__all__ = ["DIGEST_BYTES", "BucketIO", "ForwardIn", "aligned", "check_digest", "check_digests", "contiguous_span"]

DIGEST_BYTES = 8


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of 8-byte words (digest trailers, staging)."""
    return -(-nbytes // 8) * 8


def contiguous_span(shape: tuple[int, ...], box: BoxCopy, itemsize: int) -> tuple[int, int] | None:
    """(byte offset, bytes) of a box when it is one contiguous span of its buffer."""
    nd = len(shape)
    lead = 0
    while lead < nd - 1 and box.lengths[lead] == 1:
        lead += 1
    if any(box.lengths[j] != shape[j] for j in range(lead + 1, nd)):
        return None
    stride = itemsize
    offset = 0
    for j in reversed(range(nd)):
        offset += box.offsets[j] * stride
        stride *= shape[j]
    return offset, box.nbytes


class BucketIO:
    """A bucket bound to this rank's tensors: pack/unpack through a kernel program, or a
    direct view when the bucket is a single contiguous box."""

    def __init__(self, bucket: Bucket, schedule: RankSchedule, options: ExecutorOptions,
                 device: torch.device) -> None:
        self.bucket = bucket
        # Boxes a relay only stages have no buffer here: they are forwarded, not unpacked.
        own = [b for b in bucket.boxes if b.buffer != STAGED]
        refs: list[BufferRef] = []
        for b in own:
            if b.buffer not in refs:
                refs.append(b.buffer)
        self.refs = refs
        specs = [schedule.buffers[r] for r in refs]
        # A source buffer the plan casts packs into the destination's dtype (never sent
        # straight from the parameter: its bytes are not the wire's).
        wire = [schedule.wire_dtypes.get(r, s.dtype) for r, s in zip(refs, specs, strict=True)]
        self.casts = any(w != s.dtype for w, s in zip(wire, specs, strict=True))
        self.direct: tuple[BufferRef, int, int] | None = None
        if options.zero_copy and not options.verify and len(bucket.boxes) == 1 and own and not self.casts:
            only = bucket.boxes[0]
            spec = schedule.buffers[only.buffer]
            span = contiguous_span(spec.shape, only, DTYPE_ITEMSIZE[spec.dtype])
            if span is not None:
                self.direct = (only.buffer, span[0], span[1])
        self.program = None
        if self.direct is None and own:  # a direct bucket needs no kernel program
            self.program = PackProgram(
                [s.shape for s in specs], [getattr(torch, s.dtype) for s in specs],
                [BoxRegion(refs.index(b.buffer), b.offsets, b.lengths, b.packed_offset) for b in own],
                device=device, backend=options.pack_backend,
                packed_dtypes=[getattr(torch, w) for w in wire] if self.casts else None,
            )
        self._bindings: dict[tuple, object] = {}
        # The digest trailer starts 8-byte aligned after the data.
        self.trailer_offset = -(-bucket.nbytes // DIGEST_BYTES) * DIGEST_BYTES
        self.wire_bytes = (self.trailer_offset + DIGEST_BYTES * len(bucket.boxes)) if options.verify else bucket.nbytes
        # On a GPU every box's digest in one launch (box by box: ~10 launches each, and a
        # synchronisation each where compared).
        self._digests = (fused_digests.BoxDigests([(b.packed_offset, b.nbytes) for b in bucket.boxes], device)
                         if options.verify and fused_digests.usable(torch.device(device)) else None)

    def direct_view(self, tensors: Mapping[BufferRef, torch.Tensor]) -> torch.Tensor:
        return self.direct_view_of(tensors, self.direct)

    @staticmethod
    def direct_view_of(tensors: Mapping[BufferRef, torch.Tensor], span) -> torch.Tensor:
        ref, offset, nbytes = span
        return byte_view(tensors[ref]).reshape(-1)[offset : offset + nbytes]

    def _bound(self, tensors: Mapping[BufferRef, torch.Tensor], data: torch.Tensor):
        """A kernel binding for these tensors and this staging view: checks run once, later
        refits of the epoch only launch."""
        bound = [tensors[r] for r in self.refs]
        key = (data.data_ptr(), data.numel(), tuple(t.data_ptr() for t in bound))
        binding = self._bindings.get(key)
        if binding is None:
            if len(self._bindings) >= 8:  # staging slots x parameter sets; keep it small
                self._bindings.clear()
            binding = self._bindings[key] = self.program.bind(bound, data)  # type: ignore[union-attr]
        return binding

    def warm(self, tensors: Mapping[BufferRef, torch.Tensor], staging: torch.Tensor) -> bool:
        """Bind the kernel program to ``tensors`` and this staging slot ahead of the first
        refit (what a binding checks and resolves, descriptors copied to the device), so that
        refit only launches. False when there is nothing to bind or a buffer is missing."""
        if self.program is None or any(r not in tensors for r in self.refs):
            return False
        self._bound(tensors, staging[: self.bucket.nbytes])
        if self._digests is not None:
            self._digests(staging[: self.bucket.nbytes])  # its kernel variant for this slot's alignment
        return True

    def pack(self, tensors: Mapping[BufferRef, torch.Tensor], staging: torch.Tensor, verify: bool) -> None:
        data = staging[: self.bucket.nbytes]
        self._bound(tensors, data).pack()
        if verify:
            trailer = staging[self.trailer_offset : self.wire_bytes].view(torch.int64)
            if self._digests is not None:
                self._digests(data, out=trailer)
                return
            for i, b in enumerate(self.bucket.boxes):
                trailer[i] = digest(data[b.packed_offset : b.packed_offset + b.nbytes])

    def unpack(self, tensors: Mapping[BufferRef, torch.Tensor], staging: torch.Tensor, verify: bool,
               where: str) -> int:
        data = staging[: self.bucket.nbytes]
        if verify:
            trailer = staging[self.trailer_offset : self.wire_bytes].view(torch.int64)
            if self._digests is not None:
                check_digests(where, self.bucket.boxes, self._digests(data), trailer)
            else:
                for i, b in enumerate(self.bucket.boxes):
                    check_digest(where, b, data[b.packed_offset : b.packed_offset + b.nbytes], trailer[i])
        if self.program is not None:
            self._bound(tensors, data).unpack()
        return len(self.bucket.boxes) if verify else 0


def check_digest(where: str, box: BoxCopy, data: torch.Tensor, want: torch.Tensor | int) -> None:
    """``VerificationFailed`` naming the box and its buffer when ``data`` (the box's bytes
    as they arrived) does not have the digest its sender sent."""
    got = digest(data)
    if int(got) != int(want):
        raise _mismatch(where, box, int(got), int(want))


def check_digests(where: str, boxes: tuple[BoxCopy, ...], got: torch.Tensor, want: torch.Tensor) -> None:
    """:func:`check_digest` for every box at once (one synchronisation): the first box
    whose digest ``got`` differs from the sender's ``want`` is named."""
    bad = got != want
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise _mismatch(where, boxes[i], int(got[i]), int(want[i]))


def _mismatch(where: str, box: BoxCopy, got: int, want: int) -> VerificationFailed:
    return VerificationFailed(f"{where}: box {box.offsets}+{box.lengths} of buffer {box.buffer[1]!r} "
                              f"arrived with digest {got:#x}, sender had {want:#x}")


class ForwardIn:
    """A needer's side of one forward part: where each span lands (straight in a parameter
    when it is one contiguous box there, else at its place in a staging buffer) and the
    program that unpacks what landed in staging (None when nothing does). With verification
    on, the digests the relay passes on land in ``digests`` (one per box, in the part's
    order), and ``check`` compares them with the boxes where they landed, before staging is
    unpacked: verified forwards need no more staging than unverified ones."""

    def __init__(self, part: ForwardPart, schedule: RankSchedule, options: ExecutorOptions,
                 device: torch.device) -> None:
        assert part.boxes is not None
        self.part = part
        self.spans: list[tuple[tuple[BufferRef, int, int] | None, int, int]] = []
        self.landing: list[tuple[BufferRef, int, int] | None] = []  # per box: its direct span, or None (staged)
        staged: list[BoxCopy] = []
        for offset, nbytes in part.spans:
            inside = [b for b in part.boxes.boxes if offset <= b.packed_offset < offset + nbytes]
            direct = None
            if options.zero_copy and len(inside) == 1:
                spec = schedule.buffers[inside[0].buffer]
                span = contiguous_span(spec.shape, inside[0], DTYPE_ITEMSIZE[spec.dtype])
                direct = None if span is None else (inside[0].buffer, span[0], span[1])
            self.spans.append((direct, offset, nbytes))
            self.landing.extend([direct] if direct is not None else [None] * len(inside))
            if direct is None:
                staged.extend(inside)
        self.io = None if not staged else BucketIO(
            Bucket(part.nbytes, tuple(staged)), schedule,
            dataclasses.replace(options, zero_copy=False, verify=False), device)
        self.digests = (torch.empty(len(part.boxes.boxes), dtype=torch.int64, device=device)
                        if options.verify else None)

    def check(self, tensors: Mapping[BufferRef, torch.Tensor], staging: torch.Tensor | None, where: str) -> int:
        """Compare every box's digest where it landed with the one the relay passed on;
        returns the boxes checked."""
        assert self.part.boxes is not None and self.digests is not None
        for box, direct, want in zip(self.part.boxes.boxes, self.landing, self.digests, strict=True):
            data = (BucketIO.direct_view_of(tensors, direct) if direct is not None
                    else staging[box.packed_offset : box.packed_offset + box.nbytes])  # type: ignore[index]
            check_digest(where, box, data, want)
        return len(self.landing)
