"""Digests of many byte ranges of one buffer in one launch (a bucket's boxes).

The digest of a range is ``transport.buffers.digest``'s (``sum_p (2p + 1) x_p mod 2**64``
over its 8-byte words, xor its length). Taken box by box with torch ops it costs ~10
launches and, where it is compared, one synchronisation per box: a bucket of hundreds of
small tensors spends milliseconds of host time (and of the GIL an inference engine shares
with the runtime's agent thread, measured in the RL step) on launches. Here a tile table
built once per bucket drives one kernel that writes every tile's partial sums; torch folds
the tiles of each box and finishes the digests: a handful of launches per bucket, whatever
its number of boxes, and no synchronisation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from ._triton_backend import HAVE_TRITON

__all__ = ["BoxDigests", "usable"]

WORDS = 1024  # 8 KiB of a box per program
_NUM_WARPS = 4
# Tests only: run the kernel through Triton's interpreter for CPU tensors too.
_interpret_cpu = False
# "per-box" takes a GPU bucket's digests box by box, as before this kernel (benchmarks compare).
_FORMS = ("one-launch", "per-box")
_form = os.environ.get("ELASTIC_REFIT_BUCKET_DIGESTS", "one-launch")


def usable(device: torch.device) -> bool:
    """Whether :class:`BoxDigests` runs on ``device``: CUDA with Triton installed (a CPU
    takes its digests with the compiled C loop, box by box, which costs no launches), unless
    ``ELASTIC_REFIT_BUCKET_DIGESTS=per-box``."""
    if _form not in _FORMS:
        raise ValueError(f"ELASTIC_REFIT_BUCKET_DIGESTS must be one of {', '.join(_FORMS)}, got {_form!r}")
    return _form == "one-launch" and HAVE_TRITON and (
        device.type == "cuda" or (_interpret_cpu and device.type == "cpu"))


class BoxDigests:
    """The digests of the byte ranges ``(offset, nbytes)`` of a flat uint8 buffer, as one
    int64 tensor (``transport.buffers.digest`` of each range, in order). The tile table is
    built here once and lives on ``device``; a call launches."""

    def __init__(self, ranges: Sequence[tuple[int, int]], device: torch.device | str) -> None:
        device = torch.device(device)
        if not usable(device):
            raise ValueError(f"BoxDigests runs on a CUDA device with Triton and ELASTIC_REFIT_BUCKET_DIGESTS="
                             f"one-launch; here: {device}, form {_form!r}")
        starts = np.array([o for o, _ in ranges], dtype=np.int64).reshape(-1)
        sizes = np.array([n for _, n in ranges], dtype=np.int64).reshape(-1)
        if (starts < 0).any() or (sizes < 0).any():
            raise ValueError(f"byte ranges must have offsets and sizes >= 0, got {list(ranges)[:4]}...")
        self.num_ranges = len(starts)
        self.end = int((starts + sizes).max()) if self.num_ranges else 0
        words = (sizes + 7) // 8
        tiles = (words + WORDS - 1) // WORDS  # per range: its words in tiles (none when empty)
        box = np.repeat(np.arange(self.num_ranges, dtype=np.int64), tiles)
        first = np.cumsum(tiles) - tiles
        word0 = (np.arange(box.size, dtype=np.int64) - np.repeat(first, tiles)) * WORDS
        self.num_tiles = int(box.size)
        table = np.stack([starts[box], word0, sizes[box]], axis=1).reshape(-1)
        # One copy to the device (each from pageable memory waits for the stream), then views.
        held = torch.from_numpy(np.concatenate([table, box, sizes])).to(device)
        n = box.size
        self._table, self._tile_box, self._sizes = held[: 3 * n], held[3 * n : 4 * n], held[4 * n :]
        self._one_tile_each = bool((tiles == 1).all())  # then the tiles are the boxes, in order
        self._aligned = bool((starts % 8 == 0).all())
        self.device = held.device  # with its index ("cuda" alone would not match "cuda:0")

    def __call__(self, data: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The ranges' digests in ``data`` (a flat uint8 tensor on the device, at least as
        long as the furthest range), written to ``out`` when given."""
        if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous() or data.device != self.device:
            raise ValueError(f"data must be a flat contiguous uint8 tensor on {self.device}, got {data.dtype} "
                             f"of shape {tuple(data.shape)} on {data.device}")
        if data.numel() < self.end:
            raise ValueError(f"data holds {data.numel()} bytes; the ranges reach byte {self.end}")
        partial = torch.empty((self.num_tiles, 2), dtype=torch.int64, device=self.device)
        if self.num_tiles:
            from ._triton_backend import load_source

            kernel = load_source("_triton_digest.py", interpret=not data.is_cuda).segment_digest_kernel
            kernel[(self.num_tiles,)](data, self._table, partial, WORDS=WORDS,
                                      ALIGNED=self._aligned and data.data_ptr() % 8 == 0, num_warps=_NUM_WARPS)
        if self._one_tile_each:
            sums = partial
        else:
            sums = torch.zeros((self.num_ranges, 2), dtype=torch.int64, device=self.device)
            sums.index_add_(0, self._tile_box, partial)
        total = sums[:, 1] * 2 + sums[:, 0]
        if out is None:
            return total.bitwise_xor_(self._sizes)
        return torch.bitwise_xor(total, self._sizes, out=out)
