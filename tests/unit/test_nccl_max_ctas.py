"""The CTA cap of this runtime's NCCL communicators, read from its environment variable:
unset means NCCL's default, anything but an int from 1 to 32 is refused by name."""

from __future__ import annotations

import pytest

from elastic_refit.transport.nccl import MAX_CTAS_ENV, max_ctas


@pytest.mark.parametrize(("text", "want"), [(None, None), ("", None), ("  ", None), ("1", 1), ("2", 2), (" 16 ", 16), ("32", 32)])
def test_the_cap_is_nccls_default_unless_set(text, want):
    environ = {} if text is None else {MAX_CTAS_ENV: text}
    assert max_ctas(environ) == want


@pytest.mark.parametrize("text", ["0", "-1", "33", "two", "1.5"])
def test_a_cap_that_is_not_a_positive_int_is_refused_by_name(text):
    with pytest.raises(ValueError, match=rf"ELASTIC_REFIT_NCCL_MAX_CTAS must be an int from 1 to 32 .*got {text!r}"):
        max_ctas({MAX_CTAS_ENV: text})
