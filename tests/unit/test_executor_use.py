"""Which executor an attempt runs on (``runtime.driver.executor_use``, pure): the kept one
for its own plan, one beside it when the kept one is the epoch's warmed steady executor
(a catch-up must not evict it), a replacement otherwise."""

from __future__ import annotations

import pytest

from elastic_refit.runtime.driver import executor_use

STEADY, CATCH_UP, OLD = ("steady", 7), ("catch-up", 7), ("steady", 3)  # (plan fingerprint, transport id)


@pytest.mark.parametrize(("kept", "warmed", "wanted", "use", "why"), [
    (None, None, STEADY, "replace", "nothing kept yet: build and keep"),
    (STEADY, STEADY, STEADY, "keep", "the warmed steady plan again: the refit only launches"),
    (STEADY, None, STEADY, "keep", "the same plan, not warmed (no connecting ahead): still kept"),
    (STEADY, STEADY, CATCH_UP, "beside", "a rejoiner's catch-up beside the warmed one, which the next refit needs"),
    (STEADY, None, CATCH_UP, "replace", "nothing warmed: one kept, the old staging freed first"),
    (CATCH_UP, STEADY, STEADY, "replace", "a kept one-off (never warmed) gives way to the steady plan"),
    (OLD, OLD, STEADY, "replace", "last epoch's warmed executor on its old transport: replaced"),
    (STEADY, OLD, CATCH_UP, "replace", "warmed in another epoch: not this epoch's steady executor"),
])
def test_executor_use(kept, warmed, wanted, use, why):
    assert executor_use(kept, warmed, wanted) == use, why
