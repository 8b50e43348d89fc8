"""Bad input to the runtime is refused where it is given, with one line that names the
thing: ``publish`` checks a trainer's tensors and version before anything reaches etcd or
an attempt, and an inference rank's parameters are checked when the refit is built.

Trainer cases run against a real etcd (one trainer, no inference rank: a refused publish
never waits for a commit)."""

from __future__ import annotations

import math
import time
import uuid

import pytest
import torch
from elastic_refit.membership.client import EtcdClient
from elastic_refit.membership.keys import JobKeys

from elastic_refit.errors import RefitTimeout
from elastic_refit.layout import parse_spec
from elastic_refit.runtime import ElasticRefit, RefitConfig, RefitLayouts
from elastic_refit.transport.buffers import buffers_digest

pytestmark = pytest.mark.etcd

SPEC = parse_spec({
    "domains": [0, 1],
    "tensors": [
        {"name": "w", "shape": [8, 4], "dtype": "float32",
         "source": {"mesh": [0], "placements": ["R"]}, "destination": {"mesh": [1], "placements": ["R"]}},
        {"name": "b", "shape": [4], "dtype": "float32",
         "source": {"mesh": [0], "placements": ["R"]}, "destination": {"mesh": [1], "placements": ["R"]}},
    ],
})
LAYOUTS = RefitLayouts(SPEC.source, SPEC.destination)


def good() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(8, 4), "b": torch.zeros(4)}


def with_(**changes) -> dict[str, torch.Tensor]:
    tensors = good()
    for name, value in changes.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    return tensors


def aliased() -> dict[str, torch.Tensor]:
    w = torch.zeros(8, 4)
    return {"w": w, "b": w[0]}  # b is a view of w's first row


PREFIX = "trainer 't0', version 1: published buffer"
TRAINER_CASES = [
    ("missing", with_(b=None), 1, None, f"{PREFIX} 'b' is missing"),
    ("wrong shape", with_(w=torch.zeros(4, 8)), 1, None,
     f"{PREFIX} 'w' is [4, 8] torch.float32, the layout says [8, 4] float32"),
    ("wrong dtype", with_(b=torch.zeros(4, dtype=torch.float64)), 1, None,
     f"{PREFIX} 'b' is [4] torch.float64, the layout says [4] float32"),
    ("non-contiguous", with_(w=torch.zeros(4, 8).t()), 1, None, f"{PREFIX} 'w' must be contiguous"),
    ("meta device", with_(b=torch.empty(4, device="meta")), 1, None,
     f"{PREFIX} 'b' is on meta, this rank refits on cpu"),
    ("unknown name", with_(bias=torch.zeros(4)), 1, None,
     f"{PREFIX}s ['bias'] are not in the layout of rank 0"),
    ("aliased", aliased(), 1, None, f"{PREFIX}s 'b' and 'w' share memory: each buffer needs its own"),
    ("negative version", good(), -1, None, "version must be an integer >= 0, got -1"),
    ("float version", good(), 1.5, None, "version must be an integer >= 0, got 1.5"),
    ("NaN timeout", good(), 1, math.nan, "timeout_s must be a finite number of seconds > 0 (or None), got nan"),
    ("zero timeout", good(), 1, 0, "timeout_s must be a finite number of seconds > 0 (or None), got 0"),
]


@pytest.fixture
def trainer(etcd_server):
    job = "bad-" + uuid.uuid4().hex[:8]
    config = RefitConfig(job=job, role="trainer", member_id="t0", layout_rank=0, etcd=(etcd_server.endpoint,))
    with ElasticRefit(config, LAYOUTS) as refit:
        yield refit, job, etcd_server.endpoint


def test_every_bad_publish_is_one_clear_error_in_the_caller(trainer):
    refit, job, etcd = trainer
    for name, tensors, version, timeout_s, message in TRAINER_CASES:
        start = time.monotonic()
        with pytest.raises(ValueError) as info:
            refit.publish(tensors, version, timeout_s=timeout_s)
        assert str(info.value) == message, name
        assert time.monotonic() - start < 2.0, f"{name}: the refusal took {time.monotonic() - start:.1f} s"
    # Nothing of a refused publish became a source; a refused version-1 input failed version 1.
    with EtcdClient([etcd]) as client:
        keys = JobKeys(job)
        stored = [kv.key.removeprefix(keys.versions_prefix) for kv in client.get_prefix(keys.versions_prefix).kvs]
    assert stored == ["1/failed"], stored


def test_versions_only_go_forward_and_never_change_their_data(trainer):
    refit, _, _ = trainer
    data = good()
    with pytest.raises(RefitTimeout):  # no inference rank: version 5 cannot commit
        refit.publish(data, 5, timeout_s=0.3)
    with pytest.raises(RefitTimeout):  # a retry of the same version with the same data is fine
        refit.publish(data, 5, timeout_s=0.3)
    with pytest.raises(ValueError) as info:
        refit.publish(data, 3)
    assert str(info.value) == "version 3 is older than version 5, which t0 published before: versions must increase"
    other = with_(b=torch.ones(4))
    with pytest.raises(ValueError) as info:
        refit.publish(other, 5)
    before, now = buffers_digest(data), buffers_digest(other)
    assert before != now
    assert str(info.value) == (f"version 5 was published by t0 before with other data (digest {before}, now {now}): "
                               "publish a new version")


@pytest.mark.parametrize("name, parameters, message", [
    ("missing", {"w": torch.zeros(8, 4)}, "inference rank 'i0': parameter 'b' is missing"),
    ("module names that are not the layout's",
     torch.nn.ParameterDict({"weight": torch.zeros(8, 4), "bias": torch.zeros(4)}),
     "inference rank 'i0': parameters ['b', 'w'] are missing; ['bias', 'weight'] are not in the layout of rank 1"),
    ("non-contiguous", {"w": torch.zeros(4, 8).t(), "b": torch.zeros(4)},
     "inference rank 'i0': parameter 'w' must be contiguous"),
    ("meta", {"w": torch.zeros(8, 4), "b": torch.empty(4, device="meta")},
     "inference rank 'i0': parameter 'b' is on meta, this rank refits on cpu"),
    ("aliased", aliased(), "inference rank 'i0': parameters 'b' and 'w' share memory: each buffer needs its own"),
])
def test_inference_parameters_are_checked_when_the_refit_is_built(name, parameters, message):
    config = RefitConfig(job="bad", role="inference", member_id="i0", layout_rank=1, etcd=("127.0.0.1:1",))
    with pytest.raises(ValueError) as info:
        ElasticRefit(config, LAYOUTS, parameters=parameters)
    assert str(info.value) == message


@pytest.mark.parametrize("name, layout, layout_rank, message", [
    ("not a layout", {"w": "S(0)"}, 1, "layout must be a Layout (this side's) or RefitLayouts, got dict"),
    ("a rank the layout does not have", LAYOUTS, 7,
     "inference 'i0' has layout rank 7, which holds nothing in its layout (ranks 1)"),
])
def test_the_layout_and_the_layout_rank_are_checked_when_the_refit_is_built(name, layout, layout_rank, message):
    config = RefitConfig(job="bad", role="inference", member_id="i0", layout_rank=layout_rank, etcd=("127.0.0.1:1",))
    with pytest.raises(ValueError) as info:
        ElasticRefit(config, layout, parameters={})
    assert str(info.value) == message


def test_a_trainer_waiting_for_a_version_serves_nothing_and_times_out(trainer):
    """``wait_for_version`` on a trainer only raises what ends the member (the chaos worker
    holds trainers in it): a plain timeout while the member is healthy, never a ValueError."""
    refit, _job, _etcd = trainer
    with pytest.raises(RefitTimeout):
        refit.wait_for_version(10**9, timeout_s=0.05)
    assert refit.serving_version is None
