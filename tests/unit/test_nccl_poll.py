"""How often a transfer's wait on NCCL polls (``transport.nccl.poll_delay``): tight at first,
then a twentieth of what it has waited, capped by ``ELASTIC_REFIT_NCCL_POLL_MAX_S`` (read
and checked by name); a cap of 0.5 ms is the constant poll of before."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastic_refit.transport.nccl import POLL_MAX_ENV, poll_delay, poll_max_s


@pytest.mark.parametrize(("waited", "want"), [(0.0, 0.0005), (0.005, 0.0005), (0.02, 0.001), (0.04, 0.002),
                                              (1.0, 0.002), (30.0, 0.002)])
def test_the_delay_grows_with_the_wait_up_to_the_cap(waited, want):
    assert poll_delay(waited, 0.002) == pytest.approx(want)


@given(st.floats(0.0, 100.0), st.floats(0.0005, 0.05))
def test_a_wait_notices_its_event_at_most_five_percent_or_half_a_millisecond_late(waited, cap):
    delay = poll_delay(waited, cap)
    assert 0.0005 <= delay <= cap
    assert delay <= max(0.0005, 0.05 * waited) + 1e-12


def test_the_old_constant_poll_is_a_cap_of_half_a_millisecond():
    assert {poll_delay(w, 0.0005) for w in (0.0, 0.1, 10.0)} == {0.0005}


@pytest.mark.parametrize(("text", "want"), [(None, 0.002), ("", 0.002), ("0.0005", 0.0005), (" 0.01 ", 0.01),
                                            ("0.05", 0.05)])
def test_the_cap_comes_from_its_variable(text, want):
    assert poll_max_s({} if text is None else {POLL_MAX_ENV: text}) == want


@pytest.mark.parametrize("text", ["0", "0.0001", "0.06", "fast", "-1"])
def test_a_cap_out_of_range_is_refused_by_name(text):
    with pytest.raises(ValueError, match=rf"ELASTIC_REFIT_NCCL_POLL_MAX_S must be seconds from 0.0005 to 0.05, got {text!r}"):
        poll_max_s({POLL_MAX_ENV: text})
