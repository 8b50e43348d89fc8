"""Loading and launching the Triton box-copy kernel (private).

Two flavours of the same source (``_triton_copy.py``): the compiled one for CUDA tensors and
an interpreted one for CPU tensors, so the very kernel that runs on the GPU is also exercised
by CPU tests (Triton's interpreter runs it with numpy over real host addresses).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import torch

__all__ = ["HAVE_TRITON", "launch", "load_source"]

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    HAVE_TRITON = False

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
    mod = _load(interpret=buf.device.type != "cuda")
    mod.box_copy_kernel[(num_tiles,)](
        buf, desc, tile_region, PACK=pack, TILE_BYTES=tile_bytes, num_warps=num_warps
    )


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
