"""RLStepConfig's per-role environment (the RL bench's MPS share of SMs per role)."""

from __future__ import annotations

import pytest

from elastic_refit.testing.rl_run import _env
from elastic_refit.testing.rl_step import RLStepConfig

SHARE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def _config(**kw) -> RLStepConfig:
    return RLStepConfig(job="j", etcd="http://127.0.0.1:1", log_dir="/tmp/l", run_dir="/tmp/r", port=1, **kw)


def test_each_role_gets_its_own_environment_on_top_of_the_run_s():
    config = _config(env=(("A", "1"), (SHARE, "100")),
                     role_env=(("trainer", ((SHARE, "20"),)), ("inference", ((SHARE, "30"), ("B", "2")))))
    assert _env(config, 0, "trainer") == {"A": "1", SHARE: "20"}
    assert _env(config, 1, "inference") == {"A": "1", SHARE: "30", "B": "2"}


def test_a_role_without_its_own_environment_gets_the_run_s():
    config = _config(env=(("A", "1"),), role_env=(("trainer", ((SHARE, "20"),)),))
    assert _env(config, 1, "inference") == {"A": "1"}


def test_an_unknown_role_is_refused_by_name():
    with pytest.raises(ValueError, match="'engines'"):
        _config(role_env=(("engines", ((SHARE, "20"),)),))
