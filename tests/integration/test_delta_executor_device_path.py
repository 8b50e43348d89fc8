"""The executor's deltas through the codec's device path, on the CPU: every rank codes and
applies with the vectorized box codec (the form CUDA buffers take) instead of the compiled
CPU form, and, where Triton is installed, through the fused kernels in Triton's
interpreter. Same scenario and expectations as test_delta_executor.py (plain and relayed):
versions bit-exact, most bytes saved, a receiver without the base refused everywhere. So
the GPU's code path is exercised by CPU CI (with the torch forms where Triton is absent)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from elastic_refit.testing.processes import run_local_world
from tests.integration.test_delta_executor import CASE, RELAYED, _delta_rank


def _device_path_rank(rank: int, world_size: int, store: dist.Store, case, left_out: int, torn: int) -> dict:
    from elastic_refit.kernels import delta_triton

    import elastic_refit.transport.delta as delta
    import elastic_refit.transport.delta_boxes as delta_boxes
    import elastic_refit.transport.delta_many as delta_many

    delta_triton._interpret_cpu = delta_triton.HAVE_TRITON  # the kernels too, interpreted
    calls = {"encode_changes": 0, "scatter": 0, "gather_many": 0, "scatter_many": 0}
    for name in calls:
        fn = getattr(delta_triton, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        setattr(delta_triton, name, counted)

    class Vectorized(delta_boxes.Boxes):
        def __init__(self, *args, **kwargs):
            kwargs["vectorized"] = True
            super().__init__(*args, **kwargs)

    delta.Boxes = delta_many.Boxes = Vectorized  # this process only (a forked rank)
    many = delta_boxes.changed_elements_many

    def batched(*args, **kwargs):  # the GPU's form: every buffer in one compare, two read-backs
        calls["batched_compares"] += 1
        return many(*args, batched=True, **kwargs)
    calls["batched_compares"] = 0
    delta_boxes.changed_elements_many = batched
    out = _delta_rank(rank, world_size, store, case, left_out, torn)
    out["kernel_calls"] = calls
    return out


@pytest.mark.parametrize("case", [CASE, RELAYED], ids=["plain", "relayed"])
def test_the_device_path_gives_the_same_refits(case):
    from elastic_refit.kernels import delta_triton

    plan = case.plan()
    left_out, torn = min(plan.destination.ranks), max(plan.destination.ranks)
    ranks = run_local_world(_device_path_rank, plan.topology.num_ranks, (case, left_out, torn), timeout_s=300)
    assert all(r.ok for r in ranks), [(r.rank, r.error_type, r.error[:800]) for r in ranks if not r.ok]
    by_rank = {r.rank: r.value for r in ranks}
    for rank, out in by_rank.items():
        assert out["problems"] == [], (rank, out["problems"])
        assert len(out["reports"]) == 3, (rank, out["error"])
    full = sum(o["reports"][0]["network_send_bytes"] + o["reports"][0]["intra_send_bytes"] for o in by_rank.values())
    saved = sum(o["reports"][1]["network_saved_bytes"] + o["reports"][1]["intra_saved_bytes"] for o in by_rank.values())
    assert saved > 0.8 * full, (saved, full)
    errors = {r: o["error"] for r, o in by_rank.items()}
    assert all(e is not None and e[0] == 3 for e in errors.values()), errors  # the torn rank fails everywhere
    calls = [o["kernel_calls"] for o in by_rank.values()]
    # Senders compare all their buffers at once per refit (versions 2 and 3 go as deltas).
    assert sum(c["batched_compares"] for c in calls) >= 2, calls
    if delta_triton.HAVE_TRITON:  # a message's reads and writes over all its buffers: one launch each
        assert sum(c["gather_many"] for c in calls) > 0 and sum(c["scatter_many"] for c in calls) > 0, calls
