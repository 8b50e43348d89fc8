"""The buffer digest (``transport.buffers.digest``): its value is a function of the bytes
alone (a plain-Python definition, any length, any byte offset, any cut into chunks), a
changed word always changes it, and swapped words change it except in the one case its
formula names."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import elastic_refit.transport.buffers as buffers
from elastic_refit.transport.buffers import digest, digest_reference

ROW_BYTES = 8 * buffers._DIGEST_ROW
MASK = (1 << 64) - 1


def as_tensor(data: bytes, offset: int = 0) -> torch.Tensor:
    """``data`` as a uint8 tensor starting ``offset`` bytes into its storage."""
    raw = torch.tensor(list(bytes(offset) + data), dtype=torch.uint8) if data or offset else torch.zeros(0, dtype=torch.uint8)
    return raw[offset:]


def words_tensor(words: list[int]) -> torch.Tensor:
    return torch.tensor(words, dtype=torch.int64).view(torch.uint8)


@pytest.fixture
def small_chunks(monkeypatch):
    """Cut the chunked form into steps of one row, so that small data crosses chunks."""
    monkeypatch.setitem(buffers._DIGEST_CHUNK, "cpu", ROW_BYTES)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 15))
def test_small_digest_is_the_reference_at_any_length_and_offset(data, offset):
    assert int(digest(as_tensor(data, offset))) == digest_reference(data)


@pytest.mark.parametrize("nbytes", [ROW_BYTES - 1, ROW_BYTES, ROW_BYTES + 1, ROW_BYTES + 8,
                                    3 * ROW_BYTES + 5, 5 * ROW_BYTES + 8 * 17])
@pytest.mark.parametrize("offset", [0, 1, 4, 8])
@pytest.mark.parametrize("chunked", [False, True])
def test_large_digest_is_the_reference_across_rows_chunks_and_unaligned_offsets(nbytes, offset, chunked, monkeypatch):
    if chunked:
        monkeypatch.setitem(buffers._DIGEST_CHUNK, "cpu", ROW_BYTES)
    gen = torch.Generator().manual_seed(nbytes + offset)
    raw = torch.randint(0, 256, (nbytes + offset,), dtype=torch.uint8, generator=gen)
    data = raw[offset:]
    assert int(digest(data)) == digest_reference(data.numpy().tobytes())
    # the same bytes elsewhere in memory (aligned, in a fresh allocation) digest the same
    assert int(digest(data.clone())) == int(digest(data))


def test_digest_is_a_signed_int64_tensor_on_the_data_device():
    h = digest(torch.full((ROW_BYTES * 2,), 0xFF, dtype=torch.uint8))
    assert h.dtype == torch.int64 and h.dim() == 0 and h.device.type == "cpu"
    assert int(digest(torch.zeros(0, dtype=torch.uint8))) == 0
    assert int(digest(torch.zeros(5, dtype=torch.uint8))) == 5  # zero words, length 5: the length counts


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=1, max_size=200), st.data())
def test_a_changed_byte_always_changes_the_digest(data, draw):
    at = draw.draw(st.integers(0, len(data) - 1))
    flip = draw.draw(st.integers(1, 255))
    changed = bytearray(data)
    changed[at] ^= flip
    assert int(digest(as_tensor(bytes(changed)))) != int(digest(as_tensor(data)))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(-2**63, 2**63 - 1), min_size=1, max_size=40), st.data())
def test_a_changed_word_always_changes_the_digest_whatever_the_change(words, draw):
    at = draw.draw(st.integers(0, len(words) - 1))
    delta = draw.draw(st.sampled_from([1, -1, 2**63, 2**62, 2**32, 3]) | st.integers(1, MASK))
    changed = list(words)
    value = (changed[at] + delta) & MASK
    changed[at] = value - (1 << 64) if value >> 63 else value
    assert int(digest(words_tensor(changed))) != int(digest(words_tensor(words)))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-2**63, 2**63 - 1), min_size=2, max_size=40), st.data())
def test_swapped_words_change_the_digest_except_where_the_formula_says(words, draw):
    p = draw.draw(st.integers(0, len(words) - 2))
    q = draw.draw(st.integers(p + 1, len(words) - 1))
    swapped = list(words)
    swapped[p], swapped[q] = swapped[q], swapped[p]
    unchanged = (2 * (q - p) * (words[p] - words[q])) & MASK == 0  # the one blind spot, exactly
    assert (int(digest(words_tensor(swapped))) == int(digest(words_tensor(words)))) == unchanged
    if words[p] != words[q] and q - p == 1 and (words[p] - words[q]) % 2**63:
        assert not unchanged  # adjacent words that differ below the top bit: always seen


def test_changes_the_earlier_form_missed_are_seen(small_chunks):
    # The earlier row + column form weighed word 1023 of row 0 by 2048: its top 11 bits
    # were invisible. Every weight is odd now.
    data = torch.zeros(4 * ROW_BYTES, dtype=torch.uint8)
    base = int(digest(data))
    for word in (1023, 2047, buffers._DIGEST_ROW - 1, buffers._DIGEST_ROW, 3 * buffers._DIGEST_ROW + 5):
        changed = data.clone()
        changed[8 * word + 7] = 0x80  # the top bit of that word
        assert int(digest(changed)) != base, word


def test_a_write_anywhere_in_a_large_buffer_is_seen(small_chunks):
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (6 * ROW_BYTES + 3,), dtype=torch.uint8, generator=gen)
    base = int(digest(data))
    for at in (0, 7, ROW_BYTES - 1, ROW_BYTES, 2 * ROW_BYTES + 12345, data.numel() - 1):
        changed = data.clone()
        changed[at] ^= 1
        assert int(digest(changed)) != base, at
        assert int(digest(changed[1:])) != int(digest(data[1:])) or at == 0, at  # unaligned too


@pytest.mark.parametrize("nbytes, offset", [(0, 0), (13, 3), (ROW_BYTES, 0), (3 * ROW_BYTES + 5, 1),
                                            (2 * ROW_BYTES + 16, 8)])
def test_the_torch_form_the_gpu_runs_equals_the_cpu_form(nbytes, offset, small_chunks):
    gen = torch.Generator().manual_seed(nbytes)
    data = torch.randint(0, 256, (nbytes + offset,), dtype=torch.uint8, generator=gen)[offset:]
    expected = digest_reference(data.numpy().tobytes())
    assert int(buffers._digest_torch(data)) == expected
    assert int(digest(data)) == expected


# ---- the two CPU forms: compiled (_digest.c, when built) and numpy (the fallback) --------

def _compiler_and_headers() -> bool:
    """Whether this machine can build the compiled form (then an install must have)."""
    import shutil
    import sysconfig
    from pathlib import Path

    include = sysconfig.get_paths().get("include")
    return (shutil.which("cc") or shutil.which("gcc")) is not None and bool(include) and \
        (Path(include) / "Python.h").is_file()


@pytest.fixture(params=["compiled", "numpy"])
def cpu_form(request, monkeypatch):
    """Run the test with ``digest`` on the CPU taking one form. The compiled one must exist
    wherever it can be built (an install built it, or pip install -e . was not rerun)."""
    if request.param == "numpy":
        monkeypatch.setattr(buffers, "_native", None)
    elif buffers._native is None:
        if _compiler_and_headers():
            pytest.fail("the compiled digest (elastic_refit/transport/_digest.c) was not built although this "
                        "machine has a compiler and Python.h: run pip install -e . again")
        pytest.skip("no compiler or Python headers here: the compiled digest was not built")
    return request.param


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=600), st.integers(0, 15))
def test_each_cpu_form_is_the_reference_at_any_length_and_offset(cpu_form, data, offset):
    assert int(digest(as_tensor(data, offset))) == digest_reference(data)


@pytest.mark.parametrize("seed", range(6))
def test_each_cpu_form_is_the_reference_on_random_large_sizes_and_offsets(cpu_form, seed):
    gen = torch.Generator().manual_seed(seed)
    nbytes = int(torch.randint(0, 4 * ROW_BYTES, (1,), generator=gen))  # most not a multiple of 8 or of 64
    offset = int(torch.randint(0, 64, (1,), generator=gen))
    data = torch.randint(0, 256, (nbytes + offset,), dtype=torch.uint8, generator=gen)[offset:]
    assert int(digest(data)) == digest_reference(data.numpy().tobytes()), (nbytes, offset)


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 9, 63, 64, 65, 127, 128, 129, 8 * 64 + 7])
@pytest.mark.parametrize("offset", [0, 1, 3, 8, 13])
def test_each_cpu_form_is_the_reference_around_word_and_block_edges(cpu_form, nbytes, offset):
    # all-ones bytes: every word is 2**64 - 1, so every weighted sum wraps around
    data = torch.full((nbytes + offset,), 0xFF, dtype=torch.uint8)[offset:]
    assert int(digest(data)) == digest_reference(bytes([0xFF]) * nbytes)
    data = torch.arange(nbytes + offset, dtype=torch.uint8)[offset:]
    assert int(digest(data)) == digest_reference(data.numpy().tobytes())


def test_the_compiled_form_reads_any_contiguous_buffer_and_refuses_strided_ones():
    if buffers._native is None:
        pytest.skip("the compiled digest was not built here")
    data = bytes(range(256)) * 5 + b"xyz"
    expected = digest_reference(data)
    assert buffers._finish_sum(buffers._native.sum(data), len(data)) == expected
    assert buffers._finish_sum(buffers._native.sum(memoryview(data)[3:]), len(data) - 3) == \
        digest_reference(data[3:])
    strided = torch.arange(64, dtype=torch.uint8)[::2]  # digest copies what is not contiguous
    assert int(digest(strided)) == digest_reference(strided.contiguous().numpy().tobytes())
    with pytest.raises(ValueError, match="not C-contiguous"):  # numpy's answer to PyBUF_SIMPLE
        buffers._native.sum(strided.numpy())


def _views():
    gen = torch.Generator().manual_seed(11)
    u8 = torch.randint(0, 256, (20, 300), dtype=torch.uint8, generator=gen)
    bf = torch.randn(16, 200, generator=gen).to(torch.bfloat16)
    f32 = torch.randn(5, 8, 70, generator=gen)
    return {
        "uint8 rows of 287 bytes, odd starts": u8[:, 3:290],
        "bf16 rows of 370 bytes": bf[2:9, 5:190],
        "fp32 two outer dims, runs of 264 bytes": f32[:, 1:5, 2:68],
        "fp32 middle dim cut, runs of 1120 bytes": f32[1:4, 2:6, :],
        "fp32 one row": f32[2, 3, 1:69],
        "transposed (4-byte runs: copied)": f32[0].t(),
        "expanded (stride 0)": bf[3, :150].expand(3, 150),
        "empty": f32[:, 2:2, :],
    }


@pytest.mark.parametrize("name", sorted(_views()))
def test_view_digest_is_the_digest_of_the_contiguous_bytes(cpu_form, name):
    view = _views()[name]
    expected = digest_reference(view.contiguous().view(torch.uint8).numpy().tobytes() if view.numel() else b"")
    assert buffers.view_digest(view) == expected


def test_a_strided_view_with_long_runs_is_read_in_place_not_copied(monkeypatch):
    if buffers._native is None:
        pytest.skip("the compiled digest was not built here")
    view = _views()["fp32 two outer dims, runs of 264 bytes"]
    expected = digest_reference(view.contiguous().numpy().tobytes())

    def copied(_data):
        raise AssertionError("the view was copied and digested whole")

    monkeypatch.setattr(buffers, "digest", copied)
    assert buffers.view_digest(view) == expected


def test_runs_outside_the_buffer_are_refused_before_any_read():
    if buffers._native is None:
        pytest.skip("the compiled digest was not built here")
    import numpy as np

    data = np.zeros(64, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"run 1 at byte 60 of 8 bytes is outside the 64-byte buffer"):
        buffers._native.sum_runs(data, np.array([0, 60], dtype=np.int64), 8)
    with pytest.raises(ValueError, match="offsets must be int64, got format i"):
        buffers._native.sum_runs(data, np.array([0], dtype=np.int32), 8)
    with pytest.raises(ValueError, match="run_bytes must be >= 0, got -1"):
        buffers._native.sum_runs(data, np.array([0], dtype=np.int64), -1)


def test_an_unknown_bucket_digest_form_is_refused_by_name(monkeypatch):
    from elastic_refit.kernels import digests as box_digests

    monkeypatch.setattr(box_digests, "_form", "fused")
    with pytest.raises(ValueError, match="ELASTIC_REFIT_BUCKET_DIGESTS must be one of one-launch, per-box, got 'fused'"):
        box_digests.usable(torch.device("cpu"))
    monkeypatch.setattr(box_digests, "_form", "per-box")
    assert not box_digests.usable(torch.device("cpu"))
