"""Fused delta kernels (Triton): the encode's compare and compaction, and the apply's scatter.

The torch forms in :mod:`elastic_refit.kernels.delta` are the reference; these give the same
results bit for bit (tests/gpu/test_delta_triton_gpu.py on CUDA, tests/unit/test_delta_triton.py
through Triton's interpreter where Triton is installed). :mod:`~elastic_refit.kernels.delta`
uses them for CUDA tensors when Triton imports (:func:`usable`), the torch forms otherwise.

- :func:`encode_changes`: indices (int64, ascending) of the elements where ``current`` and
  ``base`` differ and, optionally, their values in ``current``. Two launches: per block of
  elements a count and one bit per element (reads both inputs once), then, after an
  exclusive scan of the counts (``torch.cumsum``), the compaction (reads the bits and only
  the changed elements' sectors of ``current``; a lane per 32 elements up to
  :data:`DENSE_FRACTION` changed, a lane per element above).
- :func:`scatter`: ``target[index] = values`` (the apply), one launch.

Inputs are flat integer views (``int8``/``uint8``, ``int16``, ``int32``, ``int64``: one
integer per element, so the comparison is of bits, not of floating-point values).
Triton is imported on first use: without it these raise ``RuntimeError`` and :func:`usable`
is False.
"""

from __future__ import annotations

import os

import torch

__all__ = ["BLOCK", "DENSE_FRACTION", "HAVE_TRITON", "encode_changes", "gather_many", "scatter", "scatter_many",
           "set_enabled", "usable", "warm_up"]

try:  # optional: CPU installs run the torch forms
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAVE_TRITON = False

BLOCK = 4096  # elements per program (a multiple of 32: the compaction reads bits by 32-bit words)
_SPARSE_WARPS = 4  # BLOCK / 32 lanes: one per word of bits
# Above this fraction of elements changed the compaction gives a lane to each element, below
# it to each 32-bit word of bits. H100, 256 MiB / 2 GiB of int16, whole encode against a
# copy: by words 0.44 / 0.52 at 1.5% changed, 0.36 / 0.45 at 3.7%, 0.23 / 0.27 at 9.5%; by
# elements 0.32 / 0.38, 0.32 / 0.37, 0.30 / 0.36 (benchmarks/RESULTS.md, 2026-12-07 fourth).
DENSE_FRACTION = 0.06
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
    starts = ends - counts  # queued before the read below: less for the GPU to wait on after it
    k = int(ends[-1])  # one device-to-host read: the output's size
    index = torch.empty(k, dtype=torch.int64, device=device)
    out = torch.empty(k, dtype=current.dtype, device=device) if values else None
    if k and k <= n * DENSE_FRACTION:
        mod.compact_sparse_kernel[(blocks,)](current, bits.view(torch.int32), starts, index,
                                             index if out is None else out, BLOCK=BLOCK, WIDE=wide, VALUES=values,
                                             num_warps=_SPARSE_WARPS)
    elif k:
        mod.compact_dense_kernel[(blocks,)](current, bits, starts, index, index if out is None else out, BLOCK=BLOCK,
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


_TABLES: dict[tuple, torch.Tensor] = {}  # buffer addresses -> their table on the device (kept: a refit's buffers stay)


def _table(buffers: list[torch.Tensor]) -> torch.Tensor:
    """The buffers' addresses as an int64 tensor on their device, kept by the addresses
    (copied to the device once, not per call: a copy from the host waits for the stream)."""
    key = (buffers[0].device, *(b.data_ptr() for b in buffers))
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= 64:
            _TABLES.pop(next(iter(_TABLES)))
        table = _TABLES[key] = torch.tensor(key[1:], dtype=torch.int64).to(buffers[0].device)
    return table


def _check_many(buffers: list[torch.Tensor], ref: torch.Tensor, index: torch.Tensor) -> None:
    if not buffers:
        raise ValueError("no buffers")
    for i, b in enumerate(buffers):
        _check_flat(f"buffers[{i}]", b)
        if b.dtype != buffers[0].dtype or b.device != buffers[0].device:
            raise ValueError(f"buffers[{i}] is {b.dtype} on {b.device}, buffers[0] {buffers[0].dtype} on "
                             f"{buffers[0].device}: one dtype and device")
    for name, t in (("ref", ref), ("index", index)):
        if t.dtype != torch.int64 or t.dim() != 1 or not t.is_contiguous() or t.device != buffers[0].device:
            raise ValueError(f"{name} must be a flat contiguous int64 tensor on {buffers[0].device}, got {t.dtype} "
                             f"of shape {tuple(t.shape)} on {t.device}")
    if ref.numel() != index.numel():
        raise ValueError(f"{ref.numel()} refs for {index.numel()} indices")


def gather_many(buffers: list[torch.Tensor], ref: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``out[i] = buffers[ref[i]][index[i]]`` (flat integer buffers of one dtype and device;
    ``ref``, ``index`` int64, in range) in one launch."""
    _check_many(buffers, ref, index)
    k = index.numel()
    out = torch.empty(k, dtype=buffers[0].dtype, device=buffers[0].device)
    if k:
        _module(buffers[0]).gather_many_kernel[(-(-k // SCATTER_BLOCK),)](
            _table(buffers), ref, index, out, k, U=buffers[0].element_size(), BLOCK=SCATTER_BLOCK, num_warps=4)
    return out


def scatter_many(buffers: list[torch.Tensor], ref: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``buffers[ref[i]][index[i]] = values[i]`` (as :func:`gather_many`; no element
    written twice) in one launch."""
    _check_many(buffers, ref, index)
    _check_flat("values", values)
    if values.dtype != buffers[0].dtype or values.numel() != index.numel() or values.device != buffers[0].device:
        raise ValueError(f"{values.numel()} values of {values.dtype} on {values.device} for {index.numel()} indices "
                         f"into {buffers[0].dtype} on {buffers[0].device}")
    k = index.numel()
    if k:
        _module(buffers[0]).scatter_many_kernel[(-(-k // SCATTER_BLOCK),)](
            _table(buffers), ref, index, values, k, U=buffers[0].element_size(), BLOCK=SCATTER_BLOCK, num_warps=4)


def warm_up(device: torch.device | str) -> int:
    """Compile (or load from Triton's cache) every delta kernel variant the codec launches
    on ``device`` (compare and both compactions, with and without values, scatter, gather
    and scatter over many buffers, for elements of 1, 2, 4 and 8 bytes; one variant each
    whatever the sizes and offsets of later calls, see ``_triton_delta._one_variant``) and
    run each once, so that a member's first delta refit does not pay for it (H100: the
    first delta version took 0.53-0.83 s against 0.04 s steady). Returns the variants run:
    0 where the kernels do not run (no Triton, a CPU)."""
    probe = torch.zeros(1, device=device)
    if not usable(probe):
        return 0
    for dtype in (torch.uint8, torch.int16, torch.int32, torch.int64):
        base = torch.zeros(BLOCK + 1, dtype=dtype, device=device)
        sparse = base.clone()
        sparse[::101] = 1  # under DENSE_FRACTION: the sparse compaction
        cur = base.clone()
        cur[::7] = 1  # above it: the dense one
        for changed in (sparse, cur):  # the dense one's result is scattered and gathered below
            index, values = encode_changes(changed, base)
            encode_changes(changed, base, values=False)  # the positions alone (kernels.delta.changed_elements)
        scatter(base, index, values)
        ref = torch.zeros_like(index)
        scatter_many([base, cur], ref, index, gather_many([base, cur], ref, index))
    if probe.is_cuda:
        torch.cuda.synchronize(probe.device)
    return 4
