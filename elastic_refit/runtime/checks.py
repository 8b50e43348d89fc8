"""What a rank hands the runtime, checked before anything moves: its layout rank, its
destination formats, and the buffers it publishes or serves. Pure: ``ValueError`` naming
the member and the buffer, never a fault found later by an attempt."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from elastic_refit.layout import Layout, TensorFormats, described_fingerprint
from elastic_refit.plan import destination_format_layout
from elastic_refit.transport.buffers import overlapping

__all__ = ["Side", "check_buffers", "check_layout_rank", "shard_of", "side_of", "tensors_of"]


@dataclass(frozen=True, slots=True)
class Side:
    """This rank's side as it describes it now: its layout, its destination formats, the
    layout of its buffers in those formats, and the fingerprint of that description."""

    layout: Layout
    formats: TensorFormats
    buffer_layout: Layout
    described: str
    shard: str = ""  # an inference rank's ``shard_of`` ("" for a trainer)


def side_of(layout: Layout, formats: TensorFormats | None, *, role: str, member_id: str, layout_rank: int) -> Side:
    """``layout`` and ``formats`` (None: none) checked for this rank; ``ValueError`` naming
    the rank, the tensor, or formats declared by a trainer."""
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a Layout, got {type(layout).__name__}")
    check_layout_rank(layout, role=role, member_id=member_id, layout_rank=layout_rank)
    formats = TensorFormats() if formats is None else formats
    if not isinstance(formats, TensorFormats):
        raise ValueError(f"formats must be a TensorFormats, got {type(formats).__name__}")
    buffer_layout = layout
    if formats:
        if role != "inference":
            raise ValueError(f"trainer {member_id!r}: formats are declared by inference ranks "
                             "(trainers publish their tensors as they are)")
        try:
            buffer_layout = destination_format_layout(layout, formats)
        except ValueError as exc:
            raise ValueError(f"inference rank {member_id!r}: {exc}") from None
    shard = shard_of(layout, layout_rank, formats) if role == "inference" else ""
    return Side(layout, formats, buffer_layout, described_fingerprint(layout, formats), shard)


def shard_of(layout: Layout, rank: int, formats: TensorFormats) -> str:
    """What ``rank`` holds, as a fingerprint: the global boxes of its pieces in its formats.
    The replicas of one shard (data parallel) share it whatever their ranks: a newcomer
    whose shard a live rank holds can catch up from it, so the leader may hold it out of an
    epoch while a version is on its way (``membership.admission``)."""
    own = layout.restrict_to_ranks([rank])
    order = np.lexsort((*own.piece_lengths.T[::-1], *own.piece_offsets.T[::-1], own.piece_tensor))
    h = hashlib.blake2b(digest_size=16)
    h.update(repr([(t.name, tuple(t.shape), str(t.dtype)) for t in own.tensors]).encode())
    h.update(formats.fingerprint.encode() if formats else b"")
    for column in (own.piece_tensor, own.piece_offsets, own.piece_lengths):
        h.update(np.ascontiguousarray(column[order], dtype=np.int64).tobytes())
    return h.hexdigest()


def check_layout_rank(layout: Layout, *, role: str, member_id: str, layout_rank: int) -> None:
    if layout_rank not in layout.ranks:
        raise ValueError(f"{role} {member_id!r} has layout rank {layout_rank}, "
                         f"which holds nothing in its layout (ranks {_describe_ranks(layout.ranks)})")


def check_buffers(layout: Layout, tensors: Mapping[str, torch.Tensor], what: str, *, layout_rank: int,
                  device: str) -> None:
    """Every buffer of ``layout_rank`` in ``layout`` is in ``tensors``, contiguous, with the
    layout's shape and dtype, on ``device``'s type, none unknown to the layout and no two
    sharing memory; else ``ValueError`` starting with ``what``."""
    device_type = torch.device(device).type
    expected = layout.buffers(layout_rank)
    missing = [b.name for b in expected if b.name not in tensors]
    unknown = sorted(set(tensors) - {b.name for b in expected})
    if missing:
        # Everything that does not match, at once: a module's names vs the layout's.
        listed = f"{what} {missing[0]!r} is missing" if len(missing) == 1 else f"{what}s {missing} are missing"
        extra = f"; {unknown} are not in the layout of rank {layout_rank}" if unknown else ""
        raise ValueError(listed + extra)
    for buffer in expected:
        t = tensors[buffer.name]
        if tuple(t.shape) != buffer.shape or str(t.dtype).removeprefix("torch.") != buffer.dtype:
            raise ValueError(f"{what} {buffer.name!r} is {list(t.shape)} {t.dtype}, the layout says "
                             f"{list(buffer.shape)} {buffer.dtype}{_format_note(layout, buffer.name, layout_rank)}")
        if not t.is_contiguous():
            raise ValueError(f"{what} {buffer.name!r} must be contiguous")
        if t.device.type != device_type:
            raise ValueError(f"{what} {buffer.name!r} is on {t.device}, this rank refits on {device}")
    if unknown:
        raise ValueError(f"{what}s {unknown} are not in the layout of rank {layout_rank}")
    shared = overlapping(tensors)
    if shared is not None:
        raise ValueError(f"{what}s {shared[0]!r} and {shared[1]!r} share memory: each buffer needs its own")


def _format_note(layout: Layout, buffer: str, layout_rank: int) -> str:
    """What a buffer of a quantized tensor is, for error messages ("" for the others):
    ``layout`` is the layout of this rank's buffers (in its formats)."""
    dtypes = {b.name: b.dtype for b in layout.buffers(layout_rank)}
    if dtypes.get(buffer) == "float8_e4m3fn":
        return " (FP8 weights: a tensor declared in formats)"
    for suffix in ("_scale_inv", "_scale"):
        base = buffer.removesuffix(suffix)
        if base != buffer and dtypes.get(base) == "float8_e4m3fn":
            return f" (the scales of FP8 buffer {base!r}, one per block)"
    return ""


def tensors_of(tensors: Mapping[str, torch.Tensor] | torch.nn.Module) -> dict[str, torch.Tensor]:
    """Buffer name -> tensor from a module (its named parameters) or a mapping (a state
    dict); DTensors give their local shards (views: writes land in the parameter). The
    layout checks (shape, contiguity, ...) come after, with the rank's name in the error."""
    # No DTensor exists unless its module was imported: importing it here would cost a
    # second (a restarted rank would rejoin that much later).
    DTensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)

    if isinstance(tensors, torch.nn.Module):
        items = list(tensors.named_parameters())
    elif isinstance(tensors, Mapping):
        items = list(tensors.items())
    else:
        raise ValueError(f"expected an nn.Module or a mapping of buffer name -> tensor, got {type(tensors).__name__}")
    out: dict[str, torch.Tensor] = {}
    for name, value in items:
        if DTensor is not None and isinstance(value, DTensor):
            with torch.no_grad():
                value = value.to_local()
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name!r} is a {type(value).__name__}, not a tensor")
        out[name] = value.detach()
    return out


def _describe_ranks(ranks: tuple[int, ...]) -> str:
    if not ranks:
        return "none"
    if len(ranks) == 1:
        return str(ranks[0])
    return f"{ranks[0]}..{ranks[-1]}" if list(ranks) == list(range(ranks[0], ranks[-1] + 1)) else str(list(ranks))
