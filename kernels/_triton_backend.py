"""Loading and launching the Triton box-copy kernel (private).

Two flavours of the same source (``_triton_copy.py``): the compiled one for CUDA tensors and
an interpreted one for CPU tensors, so the very kernel that runs on the GPU is also exercised
by CPU tests (Triton's interpreter runs it with numpy over real host addresses).

Launch cost. Triton's own dispatch (``kernel[grid](...)``: binding the arguments, their
specialisation key, the cache lookup) costs ~14 us of host time per call on the H200
machine, against ~6 us for a ``copy_`` of a few MiB: buckets of small tensors packed at
0.3-0.6 of a copy's speed eager (RESULTS.md, 2026-11-29). Once a specialisation has been
compiled through that path, later launches of it go straight to the compiled kernel's
launcher (:class:`_Direct`, keyed by everything Triton specialises this kernel on: device,
direction, tile, warps and the 16-byte alignment of each pointer), passing raw pointers;
:class:`BoundLaunch` also precomputes those for a fixed buffer set (``PackBinding``). The
direct path stands aside whenever Triton launch hooks (profilers) are set, and turns itself
off for good if the launcher refuses the call (another Triton's calling convention).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import torch

__all__ = ["HAVE_TRITON", "BoundLaunch", "direct_stats", "launch", "load_source"]

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    HAVE_TRITON = False
try:
    from triton import knobs as _knobs  # where launch hooks are set (Triton 3.6 on the GPU machine)
except ImportError:  # no Triton, or an older one: no direct launches (see _DIRECT_OK)
    _knobs = None

_SRC = os.path.join(os.path.dirname(__file__), "_triton_copy.py")
_modules: dict[bool, types.ModuleType] = {}


def _load(interpret: bool) -> types.ModuleType:
    """The kernel module compiled (``interpret=False``) or interpreted on the CPU."""
    mod = _modules.get(interpret)
    if mod is not None:
        return mod
    if not HAVE_TRITON:
        raise RuntimeError("backend 'triton' needs the triton package, which is not installed")
    name = "kernels._triton_copy_interp" if interpret else "kernels._triton_copy"
    if not interpret and name in sys.modules:
        mod = sys.modules[name]
    else:
        spec = importlib.util.spec_from_file_location(name, _SRC)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        mod.__dict__["_KERNELS_INTERPRET"] = interpret
        # Registered before exec so inspect/linecache can find the source for both flavours.
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    _modules[interpret] = mod
    return mod


def launch(
    *,
    buf: torch.Tensor,
    desc: torch.Tensor,
    tile_region: torch.Tensor,
    num_tiles: int,
    pack: bool,
    tile_bytes: int,
    num_warps: int,
) -> None:
    """One launch of ``num_tiles`` programs; on CPU through Triton's interpreter."""
    if buf.device.type == "cuda":
        ptrs = (buf.data_ptr(), desc.data_ptr(), tile_region.data_ptr())
        key = _key(buf.device.index, pack, tile_bytes, num_warps, ptrs)
        direct = _direct.get(key)
        if direct is not None and direct(num_tiles, key[0], ptrs):
            return
    _dispatch(buf, desc, tile_region, num_tiles, pack, tile_bytes, num_warps)


def _dispatch(buf, desc, tile_region, num_tiles, pack, tile_bytes, num_warps) -> None:
    """Launch through Triton's own dispatch (compiles on first use); on CUDA, remember the
    compiled kernel for direct launches of the same specialisation."""
    cuda = buf.device.type == "cuda"
    mod = _load(interpret=not cuda)
    kernel = mod.box_copy_kernel[(num_tiles,)](
        buf, desc, tile_region, PACK=pack, TILE_BYTES=tile_bytes, num_warps=num_warps
    )
    _stats["dispatch"] += 1
    if cuda and _DIRECT_OK[0]:
        key = _key(buf.device.index, pack, tile_bytes, num_warps,
                   (buf.data_ptr(), desc.data_ptr(), tile_region.data_ptr()))
        if key not in _direct:
            _direct[key] = _Direct.of(kernel, (pack, tile_bytes))


def _key(device: int | None, pack: bool, tile_bytes: int, num_warps: int, ptrs: tuple[int, ...]) -> tuple:
    # Triton specialises a pointer argument on its 16-byte alignment only.
    return (device, pack, tile_bytes, num_warps, *(p % 16 == 0 for p in ptrs))


_direct: dict[tuple, _Direct | None] = {}
# Off with ELASTIC_REFIT_TRITON_DIRECT_LAUNCH=0 (every launch through Triton's dispatch).
_DIRECT_OK = [_knobs is not None and os.environ.get("ELASTIC_REFIT_TRITON_DIRECT_LAUNCH", "1") != "0"]
_stats = {"direct": 0, "dispatch": 0}


def direct_stats() -> dict[str, int]:
    """Launches of the copy kernel so far in this process: ``direct`` (straight to the
    compiled kernel) and ``dispatch`` (through Triton's dispatch), and whether the direct
    path is on (``enabled``: 0 or 1)."""
    return {**_stats, "enabled": int(_DIRECT_OK[0])}


def _hooks_set() -> bool:
    """Whether Triton launch hooks are set (a profiler): then every launch goes through
    Triton's dispatch, which calls them with the launch's metadata."""
    runtime = getattr(_knobs, "runtime", None) if _knobs is not None else None
    for name in ("launch_enter_hook", "launch_exit_hook"):
        hook = getattr(runtime, name, None)
        if hook is not None and getattr(hook, "calls", True):  # an empty HookChain is no hook
            return True
    return False


class _Direct:
    """A compiled kernel launched straight through its launcher: the arguments Triton's
    dispatch would pass, with raw pointers and no launch metadata (no hooks are set)."""

    __slots__ = ("function", "head", "metadata", "run", "tail")

    def __init__(self, run, function, metadata, tail: tuple) -> None:
        self.function = function
        self.metadata = metadata
        self.tail = tail  # the constexpr arguments, in the kernel's order after the pointers
        # The CUDA launcher's Python layer only allocates scratch, which this kernel has none
        # of: then its C entry point is called straight (its leading arguments fixed here).
        launch = getattr(run, "launch", None)
        if (launch is not None and getattr(run, "global_scratch_size", 1) == 0
                and getattr(run, "profile_scratch_size", 1) == 0):
            self.run = launch
            self.head = (run.launch_cooperative_grid, run.launch_pdl, None, None)
        else:
            self.run = run
            self.head = ()

    @classmethod
    def of(cls, kernel, tail: tuple) -> _Direct | None:
        """The direct launcher of ``kernel`` (what Triton's dispatch returned), or None when
        it is not a compiled kernel of the shape this module knows (Triton 3.x)."""
        try:
            return cls(kernel.run, kernel.function, kernel.packed_metadata, tail)
        except Exception:  # another Triton: its dispatch stays the only path
            return None

    def __call__(self, grid: int, device: int, ptrs: tuple[int, ...]) -> bool:
        """Launch on ``device``'s current stream; False (nothing launched) when the caller
        must go through Triton's dispatch instead."""
        if _hooks_set() or _current_device() != device:
            return False
        try:
            self.run(grid, 1, 1, _current_stream(device), self.function, *self.head, self.metadata, None, None,
                     None, *ptrs, *self.tail)
        except TypeError:  # the launcher's calling convention is not this one: never again
            _DIRECT_OK[0] = False
            _direct.clear()
            return False
        _stats["direct"] += 1
        return True


class BoundLaunch:
    """The launch of one direction over one fixed buffer, descriptor set and tile map (a
    ``PackBinding``'s): pointers and the specialisation key are worked out once, so a call
    is a dictionary lookup and the launcher (see the module docstring). Keeps references
    to its tensors, so the pointers stay valid while it lives."""

    __slots__ = ("args", "device", "direct", "key", "ptrs")

    def __init__(self, *, buf: torch.Tensor, desc: torch.Tensor, tile_region: torch.Tensor, num_tiles: int,
                 pack: bool, tile_bytes: int, num_warps: int) -> None:
        self.args = (buf, desc, tile_region, num_tiles, pack, tile_bytes, num_warps)
        self.device = buf.device.index if buf.device.type == "cuda" else None
        self.ptrs = (buf.data_ptr(), desc.data_ptr(), tile_region.data_ptr())
        self.key = _key(self.device, pack, tile_bytes, num_warps, self.ptrs) if self.device is not None else None
        self.direct: _Direct | None = None

    def __call__(self) -> None:
        direct = self.direct
        if direct is None and self.key is not None:
            direct = self.direct = _direct.get(self.key)
        if direct is not None and _DIRECT_OK[0] and direct(self.args[3], self.device, self.ptrs):  # type: ignore[arg-type]
            return
        _dispatch(*self.args)


# What Triton's own CUDA driver calls for the current stream and device (no Python layers).
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device: torch.cuda.current_stream(device).cuda_stream)
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


_extra: dict[tuple[str, bool], types.ModuleType] = {}


def load_source(filename: str, interpret: bool) -> types.ModuleType:
    """Another kernel source file of this folder, loaded like ``_triton_copy.py``: compiled
    (``interpret=False``) or as a separate module object for Triton's CPU interpreter."""
    key = (filename, interpret)
    mod = _extra.get(key)
    if mod is not None:
        return mod
    if not HAVE_TRITON:
        raise RuntimeError("backend 'triton' needs the triton package, which is not installed")
    stem = os.path.splitext(filename)[0]
    name = f"kernels.{stem}_interp" if interpret else f"kernels.{stem}"
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), filename))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    mod.__dict__["_KERNELS_INTERPRET"] = interpret
    sys.modules[name] = mod  # before exec: inspect/linecache find the source (see _load)
    spec.loader.exec_module(mod)
    _extra[key] = mod
    return mod
