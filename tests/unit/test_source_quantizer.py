"""The executor's FP8 senders (``SourceQuantizer``) against the in-process oracle
(``quantize_source_buffers``) on random uneven source grids (replicas, blocks cut anywhere):
the torch path, and the fused kernel through Triton's CPU interpreter (whole blocks in the
kernel, split edge blocks on the torch path), both byte for byte. The partial-amax exchange
runs over an in-memory mailbox: every rank runs twice, the first run only posts its partial
amax (what it receives then is zeros), the second quantizes with all of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from elastic_refit.kernels import _triton_backend
from hypothesis import HealthCheck, given, settings

from elastic_refit.plan import make_plan
from elastic_refit.testing.inprocess import (
    allocate_buffers,
    quantize_source_buffers,
    scatter_tensors,
)
from elastic_refit.transport.source_quant import SourceQuantizer

from .test_plan_formats import _bf16_values, fp8_cases

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not _triton_backend.HAVE_TRITON,
                                                                   reason="triton not installed"))]


class _Mailbox:
    """A transport for the exchange only: sends land in a shared dict, receives read it."""

    def __init__(self, rank: int, box: dict) -> None:
        self.rank, self.box = rank, box

    def post(self, ops):
        for op in ops:
            if op.op == "send":
                self.box[(self.rank, op.peer, op.tag)] = op.tensor.clone()
            else:
                got = self.box.get((op.peer, self.rank, op.tag))
                op.tensor.copy_(got) if got is not None else op.tensor.zero_()
        return tuple(None for _ in ops)

    def wait(self, work, peer, what) -> None:
        pass


def _bf16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(case=fp8_cases())
def test_senders_stage_the_oracles_fp8_bytes_and_scales(backend, case):
    src, dst, topology, formats, options = case
    plan = make_plan(src, dst, topology, options, formats=formats)
    q = plan.quantization
    tensors = {t.name: _bf16_values(t.shape, i) for i, t in enumerate(q.logical_source.tensors)}
    logical = allocate_buffers(q.logical_source)
    scatter_tensors(q.logical_source, tensors, logical)
    want = quantize_source_buffers(plan, logical)
    ranks = sorted(set(plan.source.ranks))
    quantizers = {r: SourceQuantizer(plan, r, torch.device("cpu"), backend) for r in ranks}
    box: dict = {}
    for _ in range(2):  # the first pass fills the mailbox
        staged = {}
        for r in ranks:
            source = {name: _bf16(a) for (rank, name), a in logical.items() if rank == r}
            staged[r] = quantizers[r].run(source, _Mailbox(r, box))
    for r in ranks:
        for name in quantizers[r].buffers:
            got = staged[r][name].contiguous().view(torch.uint8).numpy().reshape(-1)
            assert np.array_equal(got, want[(r, name)].view(np.uint8).reshape(-1)), (r, name)
