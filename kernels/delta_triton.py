"""Fused delta kernels (Triton): the encode's compare and compaction, and the apply's scatter.

The torch forms in :mod:`elastic_refit.kernels.delta` are the reference; these give the same
results bit for bit (tests/gpu/test_delta_triton_gpu.py on CUDA, tests/unit/test_delta_triton.py
through Triton's interpreter where Triton is installed). :mod:`~elastic_refit.kernels.delta`
uses them for CUDA tensors when Triton imports (:func:`usable`), the torch forms otherwise.

- :func:`encode_changes`: indices (int64, ascending) of the elements where ``current`` and
  ``base`` differ and, optionally, their values in ``current``. Two launches: per block of
  elements a count and one bit per element (reads both inputs once), then, after an
  exclusive scan of the counts (``torch.cumsum``), the compaction (reads the bits and only
  the changed elements' sectors of ``current``).
- :func:`scatter`: ``target[index] = values`` (the apply), one launch.

Inputs are flat integer views (``int8``/``uint8``, ``int16``, ``int32``, ``int64``: one
integer per element, so the comparison is of bits, not of floating-point values).
Triton is imported on first use: without it these raise ``RuntimeError`` and :func:`usable`
is False.
"""

from __future__ import annotations

import os

import torch

__all__ = ["BLOCK", "HAVE_TRITON", "encode_changes", "scatter", "set_enabled", "usable"]

try:  # optional: CPU installs run the torch forms
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAVE_TRITON = False

BLOCK = 2048  # elements per program (a multiple of 8: bits are packed by bytes)
SCATTER_BLOCK = 1024
_NUM_WARPS = 8
_INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
# ELASTIC_REFIT_DELTA_KERNELS=torch turns the fused kernels off (the torch reference runs).
_enabled = os.environ.get("ELASTIC_REFIT_DELTA_KERNELS", "auto") != "torch"
# Tests only: run the kernels through Triton's interpreter for CPU tensors too, so the codec's
# CUDA path (kernels.delta, transport.delta_boxes) is exercised where no GPU is.
_interpret_cpu = False


def set_enabled(enabled: bool) -> bool:
    """Turn the fused kernels on or off for this process (benchmarks compare both forms);
    returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def usable(t: torch.Tensor) -> bool:
    """Whether the codec runs these kernels for ``t``: a CUDA tensor, Triton installed and
    the kernels not turned off."""
    return _enabled and HAVE_TRITON and (t.is_cuda or (_interpret_cpu and t.device.type == "cpu"))


def _module(t: torch.Tensor):
    from elastic_refit.kernels._triton_backend import load_source

    return load_source("_triton_delta.py", interpret=not t.is_cuda)


def _check_flat(name: str, t: torch.Tensor) -> None:
    if t.dim() != 1 or not t.is_contiguous() or t.dtype not in _INTS:
        raise ValueError(f"{name} must be a flat contiguous integer tensor, got {t.dtype} of shape "
                         f"{tuple(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}")


def encode_changes(current: torch.Tensor, base: torch.Tensor, *,
                   values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(indices, values): the elements where ``current`` and ``base`` (flat integer tensors
    of one dtype and size, on one device) differ, ascending, and their values in
    ``current`` (None without ``values``). On a CPU tensor this runs Triton's interpreter
    (tests)."""
    _check_flat("current", current)
    _check_flat("base", base)
    if current.shape != base.shape or current.dtype != base.dtype or current.device != base.device:
        raise ValueError(f"current ({current.dtype}, {current.numel()}, {current.device}) and base "
                         f"({base.dtype}, {base.numel()}, {base.device}) differ in dtype, size or device")
    n = current.numel()
    device = current.device
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=device), current[:0].clone() if values else None
    mod = _module(current)
    blocks = -(-n // BLOCK)
    wide = blocks * BLOCK >= 2**31
    bits = torch.empty(blocks * (BLOCK // 8), dtype=torch.uint8, device=device)
    counts = torch.empty(blocks, dtype=torch.int32, device=device)
    mod.flag_kernel[(blocks,)](current, base, bits, counts, n, BLOCK=BLOCK, WIDE=wide, num_warps=_NUM_WARPS)
    ends = torch.cumsum(counts, 0, dtype=torch.int64)
    k = int(ends[-1])  # one device-to-host read: the output's size
    index = torch.empty(k, dtype=torch.int64, device=device)
    out = torch.empty(k, dtype=current.dtype, device=device) if values else None
    if k:
        starts = ends - counts
        mod.compact_kernel[(blocks,)](current, bits, starts, index, index if out is None else out, BLOCK=BLOCK,
                                      WIDE=wide, VALUES=values, num_warps=_NUM_WARPS)
    return index, out


def scatter(target: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``target[index] = values`` (flat integer tensors; ``index`` int64, in range, no
    duplicates: the element each one writes is then defined)."""
    _check_flat("target", target)
    _check_flat("values", values)
    if index.dtype != torch.int64 or index.dim() != 1 or not index.is_contiguous():
        raise ValueError(f"index must be a flat contiguous int64 tensor, got {index.dtype} of shape {tuple(index.shape)}")
    if values.dtype != target.dtype or values.numel() != index.numel():
        raise ValueError(f"{values.numel()} values of {values.dtype} for {index.numel()} indices into {target.dtype}")
    if not (target.device == index.device == values.device):
        raise ValueError(f"target, index and values must be on one device, got {target.device}, {index.device}, "
                         f"{values.device}")
    k = index.numel()
    if k:
        _module(target).scatter_kernel[(-(-k // SCATTER_BLOCK),)](target, index, values, k, BLOCK=SCATTER_BLOCK,
                                                                   num_warps=4)
