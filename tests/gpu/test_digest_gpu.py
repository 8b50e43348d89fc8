"""The buffer digest on CUDA equals the CPU's for the same bytes (auto-skipped without a GPU):
a destination on one device checks what a source on another digested."""

from __future__ import annotations

import pytest
import torch

import elastic_refit.transport.buffers as buffers
from elastic_refit.transport.buffers import digest, digest_reference

pytestmark = pytest.mark.gpu
ROW_BYTES = 8 * buffers._DIGEST_ROW


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 4097, ROW_BYTES - 3, ROW_BYTES, 3 * ROW_BYTES + 5, (64 << 20) + 11])
@pytest.mark.parametrize("offset", [0, 1, 6, 8])
def test_cuda_digest_equals_the_cpu_digest(nbytes, offset):
    gen = torch.Generator().manual_seed(nbytes + offset)
    host = torch.randint(0, 256, (nbytes + offset,), dtype=torch.uint8, generator=gen)
    on_gpu = host.cuda()[offset:]
    assert on_gpu.storage_offset() == offset
    expected = int(digest(host[offset:]))
    assert int(digest(on_gpu)) == expected
    if nbytes <= 3 * ROW_BYTES + 5:
        assert expected == digest_reference(host[offset:].numpy().tobytes())


def test_cuda_digest_in_several_steps_equals_one_step(monkeypatch):
    data = torch.randint(0, 256, (5 * ROW_BYTES + 3,), dtype=torch.uint8, device="cuda")
    whole = int(digest(data))
    monkeypatch.setattr(buffers, "_DIGEST_CHUNK_OTHER", ROW_BYTES)
    assert int(digest(data)) == whole
    changed = data.clone()
    changed[2 * ROW_BYTES + 7] ^= 0x80
    assert int(digest(changed)) != whole


@pytest.mark.parametrize("shift", [0, 3])
def test_a_bucket_s_digests_in_one_launch_equal_each_box_s(shift):
    """``kernels.digests.BoxDigests`` compiled: whole-word and byte-packed boxes, partial
    last words, boxes of many tiles, each equal to the box's own digest."""
    from elastic_refit.kernels.digests import WORDS, BoxDigests

    sizes = [0, 1, 7, 8, 9, 4096, 8 * WORDS + 3, 5 * 8 * WORDS, (16 << 20) + 5, 24]
    ranges, position = [], 0
    for n in sizes:
        ranges.append((position, n))
        position += n
    gen = torch.Generator().manual_seed(shift)
    data = torch.randint(0, 256, (position + shift,), dtype=torch.uint8, generator=gen).cuda()[shift:]
    want = torch.stack([digest(data[o : o + n]) for o, n in ranges])
    assert torch.equal(BoxDigests(ranges, data.device)(data), want)
    words = [(o - o % 8, n) for o, n in ranges]  # the same sizes on whole words (overlapping: fine)
    want = torch.stack([digest(data[o : o + n]) for o, n in words])
    assert torch.equal(BoxDigests(words, data.device)(data), want)
