"""One chaos run per test module: a module's matrices share its warm workers and etcd, so
the workers import torch once instead of once per matrix (7 s of the quick matrix's 67 s)."""

from __future__ import annotations

import pytest
from elastic_refit.chaos.runner import ChaosRun


@pytest.fixture(scope="module")
def chaos_run():
    """A gloo run (default deadline) that the module's tests hand to ``run_matrix``; whatever
    outlives its close fails the module's last test."""
    run = ChaosRun()
    yield run
    assert run.close() == [], "processes outlived the module's chaos run"
