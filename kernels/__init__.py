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

Quantize on the way (``kernels.quantize``, ``kernels.quant_program``; formats in
``elastic_refit.layout.formats``):

``QuantRegion(tensor_index, offsets, lengths, packed_offset_bytes, scale_offset_bytes)``
    One box of a BF16 tensor whose blocks are whole; its E4M3 bytes and its scales go to
    two ranges of the bucket (or, with ``data_strides`` / ``scale_strides``, to boxes of
    an FP8 tensor and its scale grid that live inside the bucket).
``QuantPackProgram(shapes, regions, fmt, ...)``
    Fused pack + quantize of many boxes (Triton on CUDA, one launch per group of similar
    boxes; the torch reference on CPU); ``check(buf)`` raises for NaN/Inf blocks.
``QuantUnpackProgram(weight_shapes, scale_shapes, regions, fmt, ...)``
    The inverse: E4M3 bytes and scales into the destination weight and scale tensors.
``quantize_reference``, ``block_amax``, ``combine_amax``, ``scales_from_amax``,
``quantize_with_scales``
    The reference quantizer in plain torch ops, and the pieces of a block split across
    source shards (partial amax, combined by max, then quantization with given scales).

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
from .quant_program import QuantPackProgram, QuantRegion, QuantUnpackProgram, quant_regions_nbytes
from .quantize import (
    BlockScheme,
    NonFiniteBlockError,
    block_amax,
    check_scales,
    combine_amax,
    dequantize_reference,
    quantize_reference,
    quantize_with_scales,
    scales_from_amax,
)
from .reference import pack_reference, unpack_reference

__all__ = [
    "BACKENDS",
    "BlockScheme",
    "BoxRegion",
    "NonFiniteBlockError",
    "PackBinding",
    "PackProgram",
    "QuantPackProgram",
    "QuantRegion",
    "QuantUnpackProgram",
    "block_amax",
    "check_scales",
    "combine_amax",
    "dequantize_reference",
    "pack_reference",
    "packed_nbytes",
    "quant_regions_nbytes",
    "quantize_reference",
    "quantize_with_scales",
    "scales_from_amax",
    "unpack_reference",
    "warm_up",
]
