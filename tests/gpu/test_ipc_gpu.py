"""Direct reads over CUDA IPC on one GPU: trainer and inference processes share GPU 0 (it
stands for one host's GPUs), every byte verified against the pattern, mappings counted.

- colocated: 4 + 4 processes on one "host", IPC against nccl4py, bit-exact, nothing mapped
  after close;
- hierarchical: two "hosts" of 4: the bytes IPC and nccl4py carried equal the plan's split;
- a source that dies with its memory mapped: the next refit fails (typed) on every survivor,
  and closing the transport unmaps everything."""

from __future__ import annotations

import pytest

from elastic_refit.layout.models import ModelConfig
from elastic_refit.testing.colocated import ColocatedCase, colocated_plan, colocated_rank, summarise
from elastic_refit.testing.processes import nccl_rank_env, run_local_world

pytestmark = pytest.mark.gpu

TINY_MOE = ModelConfig(name="tiny-moe", hidden_size=256, num_layers=2, vocab_size=1000, num_heads=8,
                       num_kv_heads=4, head_dim=32, intermediate_size=0, num_experts=8,
                       moe_intermediate_size=128, qk_norm=True)
TWO_HOSTS = ("h0", "h0", "h1", "h1", "h0", "h0", "h1", "h1")


def _run(case: ColocatedCase, timeout_s: float = 240.0):
    return run_local_world(colocated_rank, 8, (case,), timeout_s=timeout_s, rank_env=nccl_rank_env)


@pytest.mark.parametrize("hosts", [("h0",) * 8, TWO_HOSTS], ids=["one_host", "two_hosts"])
def test_ipc_refit_is_bit_exact_and_routes_by_host(hosts):
    case = ColocatedCase(model=TINY_MOE, num_layers=2, hosts=hosts, methods=("ipc", "nccl4py"), repeat=2,
                         bucket_bytes=256 << 10, ceiling_bytes=1 << 20)
    results = _run(case)
    assert all(r.ok for r in results), [(r.rank, r.error_type, r.error[:800]) for r in results if not r.ok]
    summary = summarise(colocated_plan(case), [r.value for r in results])
    for m in ("ipc", "nccl4py"):
        assert summary["methods"][m]["problems"] == [], m
    ipc = summary["methods"]["ipc"]
    assert ipc["direct_bytes"] == summary["plan_intra_recv_bytes"] > 0
    assert ipc["base_bytes"] == summary["plan_network_recv_bytes"]
    if len(set(hosts)) == 2:
        assert summary["plan_network_recv_bytes"] > 0
    assert summary["open_mappings_after_close"] == [0] * 8
    assert [r.value.get("late_ranks", []) for r in results] == [[]] * 8  # every rank left together


def test_source_dying_while_mapped_fails_the_refit_and_unmaps():
    case = ColocatedCase(model=TINY_MOE, num_layers=2, methods=("ipc",), warmup=1, repeat=1,
                         bucket_bytes=256 << 10, timeout_s=10.0, die_rank=0)
    results = _run(case, timeout_s=120.0)
    assert not results[0].ok and results[0].exitcode == 17
    for r in results[1:]:
        assert r.ok, (r.rank, r.error_type, r.error[:800])
        ipc = r.value["methods"]["ipc"]
        assert ipc["problems"] == []  # the first refit, before the death, was exact
        assert ipc["second_refit"] in ("TransportAborted", "TransferRefused"), ipc["second_refit"]
        # The failed refit left the communicator's kernel stuck on the dead source: the
        # mappings waited (deferred) until the harness aborted the communicator, then went.
        assert ipc["pending_after_abort"] == 0
        assert ipc["open_mappings_after_close"] == 0
        if r.rank >= 4:  # readers had the dead source mapped
            assert ipc["mapped_before"] > 0
