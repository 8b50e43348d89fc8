"""The bucket digest (``kernels.digests.BoxDigests``: every box's digest in one launch)
through Triton's CPU interpreter: equal to ``transport.buffers.digest`` of each box for
boxes on whole words and at any byte, empty, one byte, partial last words and boxes of many
tiles; a corrupted byte is named by its box. Skipped where Triton is not installed (the CPU
CI); tests/gpu/test_digest_gpu.py runs the kernel compiled."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from elastic_refit.kernels import digests

from elastic_refit.errors import VerificationFailed
from elastic_refit.transport.bucket_io import check_digests
from elastic_refit.transport.buffers import digest
from elastic_refit.transport.schedule import BoxCopy

SIZES = [0, 1, 7, 8, 9, 16, 8 * digests.WORDS, 8 * digests.WORDS + 3, 2 * 8 * digests.WORDS + 8, 5000, 24]


@pytest.fixture(autouse=True)
def _interpreted(monkeypatch):
    monkeypatch.setattr(digests, "_interpret_cpu", True)


def _ranges(gaps: list[int], align: int) -> list[tuple[int, int]]:
    out, position = [], 0
    for n, gap in zip(SIZES, gaps, strict=True):
        position = -(-position // align) * align
        out.append((position, n))
        position += n + gap
    return out


@pytest.mark.parametrize("align, shift", [(8, 0), (1, 0), (8, 3)], ids=["words", "bytes", "unaligned-data"])
def test_every_box_digest_equals_the_digest_of_its_bytes(align, shift):
    gen = torch.Generator().manual_seed(align + shift)
    gaps = torch.randint(0, 4, (len(SIZES),), generator=gen).tolist()
    ranges = _ranges(gaps, align)
    end = max(o + n for o, n in ranges)
    data = torch.randint(0, 256, (end + shift + 16,), dtype=torch.uint8, generator=gen)[shift:]
    boxes = digests.BoxDigests(ranges, "cpu")
    want = torch.stack([digest(data[o : o + n]) for o, n in ranges])
    assert torch.equal(boxes(data), want)
    out = torch.full((len(ranges),), 7, dtype=torch.int64)
    assert boxes(data, out=out) is out and torch.equal(out, want)
    # The bytes after a box (the next box's, a partial word's padding) never count.
    (o, n) = ranges[3]  # 8 bytes: one whole word
    data[o + n] ^= 0xFF
    assert boxes(data)[3] == want[3]


def test_a_changed_byte_changes_its_box_only_and_is_named():
    ranges = [(0, 40), (40, 13), (53, 8 * digests.WORDS + 5)]
    data = torch.randint(0, 256, (53 + 8 * digests.WORDS + 5,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(3))
    boxes = digests.BoxDigests(ranges, "cpu")
    sent = boxes(data)
    data[53 + 8 * digests.WORDS + 2] ^= 0x10  # in the big box's second tile
    got = boxes(data)
    assert torch.equal(got[:2], sent[:2]) and got[2] != sent[2]
    copies = tuple(BoxCopy((0, f"w{i}"), (0,), (n,), o, n) for i, (o, n) in enumerate(ranges))
    check_digests("recv from rank 1", copies[:2], got[:2], sent[:2])  # equal: nothing raised
    with pytest.raises(VerificationFailed, match=r"recv from rank 1: box \(0,\)\+\(\d+,\) of buffer 'w2' arrived"):
        check_digests("recv from rank 1", copies, got, sent)


def test_bad_ranges_and_data_are_refused():
    with pytest.raises(ValueError, match="offsets and sizes >= 0"):
        digests.BoxDigests([(0, -1)], "cpu")
    boxes = digests.BoxDigests([(0, 16)], "cpu")
    with pytest.raises(ValueError, match="reach byte 16"):
        boxes(torch.zeros(15, dtype=torch.uint8))
    with pytest.raises(ValueError, match="flat contiguous uint8"):
        boxes(torch.zeros(16, dtype=torch.int8))
    assert torch.equal(digests.BoxDigests([], "cpu")(torch.zeros(0, dtype=torch.uint8)),
                       torch.zeros(0, dtype=torch.int64))

