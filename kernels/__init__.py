"""Pack/unpack many N-d boxes of many tensors in one launch (layer: torch, triton, numpy).

The executor moves shard intersections: per peer it packs boxes of several local tensors into
one flat ``torch.uint8`` buffer, sends it, and the receiver unpacks it into its own tensors.

Public names
------------
``BoxRegion(tensor_index, offsets, lengths, packed_offset_bytes)``
    One box of one tensor; its ``prod(lengths) * itemsize`` bytes sit in row-major box order
    at ``packed_offset_bytes`` of the packed buffer.
``PackProgram(shapes, dtypes, regions, device=..., backend="auto"|"torch"|"triton")``
    Validates and precomputes a set of regions once (descriptor tensors on the device).
    ``pack(tensors, out)``, ``unpack(packed, tensors)``; ``bind(tensors, buf)`` returns a
    :class:`PackBinding` whose ``pack()`` / ``unpack()`` skip all per-call checks.
    On CUDA, the Triton backend is one kernel launch per call; on CPU ``backend="triton"``
    runs the same kernel in Triton's interpreter (tests), ``"torch"`` the reference.
``packed_nbytes(regions, itemsizes)``
    Bytes a packed buffer needs for some regions.
``warm_up(device)``
    Compile and run both kernel variants once (a process's first refit then does not).
``pack_reference`` / ``unpack_reference``
    The torch reference (one slice copy per region), also the test oracle.

Example::

    import torch
    from elastic_refit.kernels import BoxRegion, PackProgram

    w = torch.randn(64, 2048, 4096, dtype=torch.bfloat16, device="cuda")  # [E, I, H]
    tp = 4
    step = 2048 // tp
    regions = [BoxRegion(0, (0, k * step, 0), (64, step, 4096), k * 64 * step * 4096 * 2)
               for k in range(tp)]
    prog = PackProgram([w.shape], [w.dtype], regions, device="cuda")
    buf = torch.empty(prog.nbytes, dtype=torch.uint8, device="cuda")
    prog.pack([w], buf)          # one launch
    prog.unpack(buf, [w])        # the inverse

Speed: aligning packed offsets, box starts and row lengths to 16 bytes lets the kernel use
16-byte accesses; anything else still works with narrower ones.
"""

from .boxes import BoxRegion
from .program import BACKENDS, PackBinding, PackProgram, packed_nbytes, warm_up
from .reference import pack_reference, unpack_reference

__all__ = [
    "BACKENDS",
    "BoxRegion",
    "PackBinding",
    "PackProgram",
    "pack_reference",
    "packed_nbytes",
    "unpack_reference",
    "warm_up",
]
