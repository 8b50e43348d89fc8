"""CUDA IPC memory handles through the driver API (ctypes over ``libcuda``; no package).

An exporter names the allocation that holds a tensor (:func:`export_tensor`: a 64-byte
handle, the tensor's offset in the allocation, its bytes); an importer on the same host maps
that allocation once (:class:`MappedSegment`) and views tensors inside it. Mappings are
explicit: :meth:`MappedSegment.close` unmaps, and :func:`open_mappings` counts what this
process still has mapped, so leak checks need no guessing.

Why the driver API and not ``torch.multiprocessing``'s reductions: torch's sharing keeps a
reference counter per exported storage in shared memory, which an importer that dies never
decrements (the exporter then keeps the memory for good), and it gives no count of what is
mapped. Here the exporter hands out names only; the refit protocol (readiness signal before
reads, the closing vote after them) says when memory may be read.

Imported lazily by the IPC transport; importing this module loads nothing (``libcuda`` is
opened on first use, so the module imports on machines without a GPU).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch

__all__ = ["HANDLE_BYTES", "IpcExport", "MappedSegment", "export_tensor", "mapped", "open_mappings"]

HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


def _handle_bytes(handle: _Handle) -> bytes:
    """All 64 bytes of ``handle``. (Not ``handle.reserved``: a ``c_char`` array reads as a C
    string, cut at its first NUL, and a handle has many.)"""
    return bytes(handle)


def _handle_of(raw: bytes) -> _Handle:
    """The handle named by ``raw`` (64 bytes), NULs included (assigning ``reserved`` would
    stop copying at the first one)."""
    if len(raw) != HANDLE_BYTES:
        raise ValueError(f"an IPC handle has {HANDLE_BYTES} bytes, got {len(raw)}")
    return _Handle.from_buffer_copy(raw)


_lib: ctypes.CDLL | None = None
_lock = threading.Lock()
_open: dict[int, MappedSegment] = {}  # base address -> mapping, this process's


def _cuda() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        u64 = ctypes.c_uint64
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), u64]
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(u64), _Handle, ctypes.c_uint]
        lib.cuIpcCloseMemHandle.argtypes = [u64]
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_size_t), u64]
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _lib = lib
    return _lib


def _check(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _cuda().cuGetErrorString(result, ctypes.byref(text))
        name = text.value.decode() if text.value else "unknown error"
        raise RuntimeError(f"{what} failed: CUDA error {result} ({name})")


def _bind_context(device: torch.device) -> None:
    """Make the device's primary context current on this thread (the driver API needs one;
    the runtime API that torch uses binds it on first use)."""
    torch.cuda.set_device(device)
    torch.cuda.current_stream(device).query()


@dataclass(frozen=True, slots=True)
class IpcExport:
    """What an importer needs to view one tensor: the handle of its allocation, where the
    tensor starts in it, and its bytes."""

    handle: bytes
    offset: int
    nbytes: int

    def __post_init__(self) -> None:
        if len(self.handle) != HANDLE_BYTES:
            raise ValueError(f"an IPC handle has {HANDLE_BYTES} bytes, got {len(self.handle)}")
        if self.offset < 0 or self.nbytes < 0:
            raise ValueError(f"offset and nbytes must be >= 0, got {self.offset} and {self.nbytes}")

    def to_json(self) -> list:
        return [self.handle.hex(), self.offset, self.nbytes]

    @classmethod
    def from_json(cls, value: list) -> IpcExport:
        return cls(bytes.fromhex(value[0]), int(value[1]), int(value[2]))


def export_tensor(tensor: torch.Tensor) -> IpcExport:
    """The IPC name of ``tensor``'s memory (a contiguous CUDA tensor of this process)."""
    if tensor.device.type != "cuda" or not tensor.is_contiguous():
        raise ValueError(f"only contiguous CUDA tensors can be exported, got {tensor.device} "
                         f"contiguous={tensor.is_contiguous()}")
    _bind_context(tensor.device)
    lib = _cuda()
    ptr = tensor.data_ptr()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange")
    handle = _Handle()
    _check(lib.cuIpcGetMemHandle(ctypes.byref(handle), base.value), "cuIpcGetMemHandle")
    return IpcExport(_handle_bytes(handle), ptr - base.value, tensor.numel() * tensor.element_size())


class _Window:
    """A raw address range that ``torch.as_tensor`` can wrap (CUDA array interface)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class MappedSegment:
    """Another process's allocation mapped into this one: :meth:`view` gives tensors inside
    it; :meth:`close` unmaps (every view must be dropped first: the caller's duty)."""

    def __init__(self, handle: bytes, device: torch.device) -> None:
        _bind_context(device)
        lib = _cuda()
        raw = _handle_of(handle)
        ptr = ctypes.c_uint64()
        _check(lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), raw, _LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr.value),
               "cuMemGetAddressRange")
        self.device = device
        self.ptr = ptr.value
        self.nbytes = int(size.value) - (ptr.value - base.value)
        self.closed = False
        with _lock:
            _open[self.ptr] = self

    def view(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """``shape`` elements of ``dtype`` at ``offset`` bytes into the allocation."""
        if self.closed:
            raise RuntimeError("the mapping was closed")
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) are outside a mapping of {self.nbytes}")
        raw = torch.as_tensor(_Window(self.ptr + offset, nbytes), device=self.device)
        return raw.view(dtype).view(shape)

    def close(self) -> None:
        """Unmap; idempotent. A mapping the driver refused to unmap stays counted by
        :func:`open_mappings` (a leak check must see it), and the error is raised."""
        if self.closed:
            return
        self.closed = True
        # The driver API acts on the calling thread's context: a thread that never used the
        # device (a close at exit, on another thread than the reads) would have none.
        _bind_context(self.device)
        _check(_cuda().cuIpcCloseMemHandle(self.ptr), "cuIpcCloseMemHandle")
        with _lock:
            _open.pop(self.ptr, None)


def open_mappings() -> int:
    """How many other processes' allocations this process has mapped now."""
    with _lock:
        return len(_open)


def mapped() -> list[str]:
    """What :func:`open_mappings` counts, as ``address+bytes`` (for leak reports)."""
    with _lock:
        return [f"{ptr:#x}+{seg.nbytes}" for ptr, seg in sorted(_open.items())]
