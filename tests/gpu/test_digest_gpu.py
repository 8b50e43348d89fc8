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
