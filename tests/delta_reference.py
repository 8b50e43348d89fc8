"""The check the fused delta kernels are held to, on any device (the GPU tests and the CPU
tests through Triton's interpreter): encode gives torch's changed positions and values,
and a scatter of them onto the base rebuilds the version."""

from __future__ import annotations

import torch
from elastic_refit.kernels import delta_triton


def assert_encode_and_scatter_match_torch(cur: torch.Tensor, base: torch.Tensor) -> None:
    """``delta_triton`` against the torch reference for one (version, base) pair."""
    want = (cur != base).nonzero().flatten()
    index, values = delta_triton.encode_changes(cur, base)
    assert index.dtype == torch.int64 and torch.equal(index, want)
    assert values.dtype == cur.dtype and torch.equal(values, cur[want])
    only, none = delta_triton.encode_changes(cur, base, values=False)
    assert none is None and torch.equal(only, want)
    target = base.clone()
    delta_triton.scatter(target, index, values)
    assert torch.equal(target, cur)
