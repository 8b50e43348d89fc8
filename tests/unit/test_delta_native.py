"""The compiled CPU delta (``transport._delta``) against the format it documents, written out
in Python: every element size it specializes (1, 2, 4, 8) and one it does not (3), boxes
of several runs, gaps past one and two skip entries, digest moves, the old bytes kept, and
segments that do not fit their box refused."""

from __future__ import annotations

import numpy as np
import pytest

_delta = pytest.importorskip("elastic_refit.transport._delta")

SKIP = 255


def _reference(cur: np.ndarray, base: np.ndarray, starts: np.ndarray, run: int, u: int):
    """(entries bytes, values bytes, digest move) of a box, element by element."""
    entries, values, move, pointer = bytearray(), bytearray(), 0, 0
    for r, s in enumerate(starts.tolist()):
        for j in range(run):
            c, o = cur[(s + j) * u : (s + j + 1) * u], base[(s + j) * u : (s + j + 1) * u]
            if bytes(c) == bytes(o):
                continue
            pos = r * run + j
            gap = pos - pointer
            entries += bytes([SKIP]) * (gap // SKIP) + bytes([gap % SKIP])
            values += bytes(c)
            b = pos * u
            diff = (int.from_bytes(bytes(c), "little") - int.from_bytes(bytes(o), "little")) % 2**64
            move = (move + (2 * (b // 8) + 1) * ((diff << (8 * (b % 8))) % 2**64)) % 2**64
            pointer = pos + 1
    return bytes(entries), bytes(values), move


@pytest.mark.parametrize("u", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("density", [0.0, 0.002, 0.03, 0.5, 1.0])
def test_encode_and_apply_follow_the_format(u, density):
    rng = np.random.default_rng(u * 1000 + int(density * 1000))
    num_elements, run = 3000, 700
    base = rng.integers(0, 256, num_elements * u, dtype=np.uint8)
    cur = base.copy()
    hit = np.flatnonzero(rng.random(num_elements) < density)
    cur[hit * u + rng.integers(0, u, hit.size)] ^= 0x5A  # one byte of each chosen element
    starts = np.array([2250, 0, 1450, 720], dtype=np.int64)  # four runs of 700, apart, in any order
    entries, values, move = _reference(cur, base, starts, run, u)
    out = np.empty(4 * run * (u + 1) + 64, dtype=np.uint8)
    scratch = np.empty_like(out)
    e, k, got_move = _delta.encode(cur, base, starts, run, u, out, scratch)
    assert (e, k * u, got_move) == (len(entries), len(values), move)
    assert bytes(out[: e + k * u]) == entries + values
    target, old = base.copy(), np.empty(k * u, dtype=np.uint8)
    assert _delta.apply(target, starts, run, u, out[: e + k * u].copy(), e, True, old) == move
    want = base.copy()
    for s in starts.tolist():
        want[s * u : (s + run) * u] = cur[s * u : (s + run) * u]
    assert np.array_equal(target, want)
    assert bytes(old) == b"".join(bytes(base[(s + j) * u : (s + j + 1) * u]) for s in starts.tolist()
                                  for j in range(run) if bytes(cur[(s + j) * u : (s + j + 1) * u])
                                  != bytes(base[(s + j) * u : (s + j + 1) * u]))


def test_long_gaps_take_several_skips():
    base = np.zeros(2 * 1000, dtype=np.uint8)
    cur = base.copy()
    cur[2 * 600] = 1  # a gap of 600: two skips and 90
    starts = np.array([0], dtype=np.int64)
    out, scratch = np.empty(64, dtype=np.uint8), np.empty(64, dtype=np.uint8)
    e, k, _ = _delta.encode(cur, base, starts, 1000, 2, out, scratch)
    assert (e, k) == (3, 1) and list(out[:3]) == [SKIP, SKIP, 600 - 2 * SKIP]


def test_a_segment_past_its_box_or_too_big_for_out_is_refused():
    base = np.zeros(16, dtype=np.uint8)
    starts = np.array([0], dtype=np.int64)
    with pytest.raises(ValueError, match="does not fit its box"):
        _delta.apply(base.copy(), starts, 8, 2, np.array([9, 0, 0], dtype=np.uint8), 1, True, None)  # element 9 of 8
    with pytest.raises(ValueError, match="does not fit its box"):
        _delta.apply(base.copy(), starts, 8, 2, np.array([0, 7], dtype=np.uint8), 1, True, None)  # half a value
    with pytest.raises(ValueError, match="itemsize"):
        _delta.apply(base.copy(), starts, 8, 0, np.array([0], dtype=np.uint8), 1, True, None)
    cur = np.arange(16, dtype=np.uint8)
    small = np.empty(4, dtype=np.uint8)
    assert _delta.encode(cur, base, starts, 8, 2, small, small.copy())[0] == -1  # does not fit: sent in full
