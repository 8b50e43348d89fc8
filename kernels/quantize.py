"""Reference block quantizer (plain torch ops) and the building blocks of split blocks.

Formats (see ``elastic_refit.layout.formats``): ``fp8-block{N}`` (N x N blocks of the last two
dims, ``float8_e4m3fn`` elements, ``float32`` scale_inv = amax / 448, DeepSeek-V3's layout) and
``mxfp8`` (1 x 32 blocks along the last dim, E8M0 shared exponents stored as ``uint8`` codes,
OCP MX v1.0). Functions take a format object with ``kind`` and ``block_shape`` (a
``DestinationFormat``) or a :class:`BlockScheme`.

The arithmetic, step by step, in float32 (the Triton kernel does exactly these steps):

1. ``x`` is widened to float32 (exact for bf16). Magnitudes below 2**-126 (float32, and so
   bf16, subnormals) count as zeros of the same sign: GPUs run Triton code with denormals
   flushed, CPUs do not, and a subnormal weight carries no information at FP8 precision
   anyway, so both sides flush explicitly and agree bit for bit.
2. ``amax`` of each block (partial edge blocks: only their real elements).
3. fp8-block: ``scale_inv = amax / 448`` (IEEE division), raised to 2**-126 when it would be
   subnormal (again: no subnormal arithmetic anywhere), and **1.0 for an all-zero block**
   (any scale dequantizes zeros exactly; 1.0 keeps ``x / scale`` free of 0/0 and is a
   recognisable neutral value). Elements: ``clamp(x / scale_inv, -448, 448)`` cast
   round-to-nearest-even to float8_e4m3fn.
   mxfp8: shared exponent ``floor(log2(amax)) - 8`` (8: E4M3's largest exponent), clamped to
   E8M0's [-127, 127], stored as code ``exponent + 127``; an all-zero block gets code 127
   (scale 1.0, same reason). Elements: ``clamp(x * 2**-exponent, -448, 448)`` cast as above
   (a multiplication by a power of two: exact).
4. **Non-finite values (NaN, +-Inf): a block holding one is poisoned, never silently
   quantized**: its scale is NaN (float32 ``0x7fc00000``; E8M0 code 255, the MX NaN) and
   all its elements are ``0x7f`` (E4M3 NaN). E4M3 has no infinity, and quantizing around
   an Inf would scale the rest of the block to zeros, a plausible-looking wrong weight. The
   kernels propagate poisoned blocks deterministically (they cannot raise); the checks
   (:func:`quantize_reference` by default, :func:`check_scales`, the programs' ``check``)
   raise :class:`NonFiniteBlockError` naming the tensor and the block, so a diverged
   trainer's version is refused before any inference rank could serve it.

Split blocks: a block cut by source shard boundaries is quantized exactly by combining the
holders' partial :func:`block_amax` with :func:`combine_amax` (``max``; NaN marks a poisoned
part and propagates), then each holder runs :func:`scales_from_amax` and
:func:`quantize_with_scales` on its own sub-box with ``origin`` = where the sub-box starts
inside its first block. Every element's byte depends only on its value and its block's scale,
so the result is bit-identical to quantizing the whole block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "E4M3_MAX",
    "E4M3_NAN",
    "E8M0_NAN",
    "FP32_MIN_NORMAL",
    "BlockScheme",
    "NonFiniteBlockError",
    "as_scheme",
    "block_amax",
    "check_scales",
    "combine_amax",
    "dequantize_reference",
    "e4m3_bits_reference",
    "poisoned",
    "quantize_reference",
    "quantize_with_scales",
    "scale_shape",
    "scales_from_amax",
]

E4M3_MAX = 448.0
E4M3_EMAX = 8  # exponent of E4M3's largest normal (448 = 1.75 * 2**8)
E4M3_NAN = 0x7F  # the byte of a poisoned element
E8M0_NAN = 0xFF
E8M0_BIAS = 127
FP32_MIN_NORMAL = 2.0**-126
_F32_NAN_BITS = 0x7FC00000
_KINDS = ("fp8-block", "mxfp8")


@dataclass(frozen=True, slots=True)
class BlockScheme:
    """What the kernels need of a destination format: its kind and block shape."""

    kind: str
    block_shape: tuple[int, int]

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"quantization kind must be one of {_KINDS}, got {self.kind!r}")
        shape = tuple(self.block_shape)
        if len(shape) != 2 or not all(isinstance(b, int) and b >= 1 for b in shape):
            raise ValueError(f"block_shape must be two positive ints, got {self.block_shape!r}")
        if self.kind == "mxfp8" and shape != (1, 32):
            raise ValueError(f"mxfp8 blocks are 1 x 32 (OCP MX), got {shape}")
        object.__setattr__(self, "block_shape", shape)

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float32 if self.kind == "fp8-block" else torch.uint8

    @property
    def scale_itemsize(self) -> int:
        return 4 if self.kind == "fp8-block" else 1


def as_scheme(fmt: object) -> BlockScheme:
    """A :class:`BlockScheme` from one, or from a format with ``kind``/``block_shape``."""
    if isinstance(fmt, BlockScheme):
        return fmt
    kind = getattr(fmt, "kind", None)
    block = getattr(fmt, "block_shape", None)
    if kind not in _KINDS or block is None:
        raise ValueError(f"not a quantized destination format: {fmt!r}")
    return BlockScheme(kind, tuple(block))


class NonFiniteBlockError(ValueError):
    """A block to quantize holds NaN or Inf (a diverged trainer?); nothing may be served.

    ``tensor`` names the tensor, ``block`` is the block's index in the scale grid and
    ``box`` its element box ``(offsets, lengths)``.
    """

    def __init__(self, tensor: str, block: tuple[int, ...], box: tuple[tuple[int, ...], tuple[int, ...]]):
        self.tensor, self.block, self.box = tensor, block, box
        super().__init__(
            f"tensor {tensor!r}: block {list(block)} (elements at {list(box[0])} + {list(box[1])}) "
            f"holds NaN or Inf; refusing to quantize it"
        )


def scale_shape(shape: Sequence[int], fmt: object, origin: tuple[int, int] = (0, 0)) -> tuple[int, ...]:
    """Blocks a box of ``shape`` touches when its first element sits at ``origin`` inside
    its first block: ``[..., rows, cols]`` of the scale grid."""
    br, bc = as_scheme(fmt).block_shape
    if len(shape) < 2:
        raise ValueError(f"block quantization needs >= 2 dims, got shape {tuple(shape)}")
    *lead, rows, cols = (int(s) for s in shape)
    return (*lead, -(-(origin[0] + rows) // br), -(-(origin[1] + cols) // bc))


def _check_origin(origin: tuple[int, int], block: tuple[int, int]) -> None:
    if len(origin) != 2 or not all(0 <= o < b for o, b in zip(origin, block, strict=True)):
        raise ValueError(f"origin {origin} must lie inside one block {block}")


def _widen(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 values with subnormals flushed to signed zero, and the non-finite mask."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"block quantization takes bfloat16/float16/float32, got {x.dtype}")
    bits = x.float().contiguous().view(torch.int32)
    exponent = bits & 0x7F800000
    nonfinite = exponent == 0x7F800000
    # Integer tests: exact on every device, and untouched by flush-to-zero modes.
    bits = torch.where((exponent == 0) | nonfinite, bits & ~0x7FFFFFFF, bits)
    return bits.view(torch.float32), nonfinite


def _blocks(t: torch.Tensor, block: tuple[int, int], origin: tuple[int, int]) -> torch.Tensor:
    """``t`` zero-padded to whole blocks (``origin`` in front) as ``[..., nbr, br, nbc, bc]``."""
    br, bc = block
    rows, cols = t.shape[-2:]
    nbr, nbc = -(-(origin[0] + rows) // br), -(-(origin[1] + cols) // bc)
    pad = (origin[1], nbc * bc - origin[1] - cols, origin[0], nbr * br - origin[0] - rows)
    if not any(pad):  # whole blocks: a view, no copy
        return t.reshape(*t.shape[:-2], nbr, br, nbc, bc)
    # Zeros: they never raise a block's amax (F.pad has no bool kernel).
    padded = F.pad(t.to(torch.uint8), pad).bool() if t.dtype == torch.bool else F.pad(t, pad)
    return padded.reshape(*t.shape[:-2], nbr, br, nbc, bc)


def _expand(per_block: torch.Tensor, shape: Sequence[int], block: tuple[int, int],
            origin: tuple[int, int]) -> torch.Tensor:
    """Each element's block value, for a box of ``shape`` at ``origin``."""
    br, bc = block
    rows, cols = shape[-2:]
    full = per_block.repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)
    return full[..., origin[0] : origin[0] + rows, origin[1] : origin[1] + cols]


# Elements per slab of the two functions below: their float32 temporaries are a few times a
# slab, so a multi-GB expert piece needs tens of MB, not tens of GB (and a CPU's caches hold
# them); on CUDA a slab is large enough that launches stay a small part of the time.
_SLAB_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26}


def _slabs(shape: Sequence[int], block: tuple[int, int], origin: tuple[int, int],
           max_elements: int):
    """Cut a box of ``shape`` at ``origin`` into slabs of at most about ``max_elements``
    elements that never cut a block: runs of the first dim while a box has more than two,
    then whole block rows (never less than one block row). Yields ``(element index, block
    index, slab origin)``: the slab's index into the box and into its block grid."""
    n = 1
    for d in shape:
        n *= int(d)
    if n <= max_elements:
        yield (), (), origin
        return
    if len(shape) > 2:
        inner = n // int(shape[0])
        if inner <= max_elements:
            step = max_elements // inner
            for start in range(0, int(shape[0]), step):
                run = slice(start, min(start + step, int(shape[0])))
                yield (run,), (run,), origin
        else:
            for i in range(int(shape[0])):
                for e, b, o in _slabs(shape[1:], block, origin, max_elements):
                    yield (i, *e), (i, *b), o
        return
    rows, cols = int(shape[0]), int(shape[1])
    br = block[0]
    step = max(1, max_elements // (cols * br)) * br  # rows of a slab, in whole blocks
    start = 0
    while start < rows:
        first = origin[0] + start  # the slab's first row, counted from its first block's top
        end = min(rows, (first // br) * br + step - origin[0])
        yield ((slice(start, end),), (slice(first // br, -(-(origin[0] + end) // br)),),
               (first % br, origin[1]))
        start = end


def _slab_elements(x: torch.Tensor) -> int:
    return _SLAB_ELEMENTS["cuda" if x.device.type == "cuda" else "cpu"]


def block_amax(x: torch.Tensor, fmt: object, origin: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Per-block absolute maximum (float32) of the box ``x``, whose first element sits at
    ``origin`` (row, col) inside its first block; shape :func:`scale_shape`. A block with a
    NaN or Inf among the box's elements gets NaN (it poisons any combination)."""
    scheme = as_scheme(fmt)
    _check_origin(origin, scheme.block_shape)
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"block quantization takes bfloat16/float16/float32, got {x.dtype}")
    max_elements = _slab_elements(x)
    if x.numel() <= max_elements:
        return _block_amax(x, scheme, origin)
    out = torch.empty(scale_shape(x.shape, scheme, origin), dtype=torch.float32, device=x.device)
    for e, b, o in _slabs(x.shape, scheme.block_shape, origin, max_elements):
        out[b] = _block_amax(x[e], scheme, o)
    return out


def _block_amax(x: torch.Tensor, scheme: BlockScheme, origin: tuple[int, int]) -> torch.Tensor:
    # |x| with subnormals flushed, by integer ops on the float32 bits (exact everywhere);
    # NaN and Inf stay, so a block's max is non-finite exactly when it holds one: one pass,
    # no mask of its own. Reduced along the contiguous block columns first, then the rows
    # (one strided reduction over both dims is several times slower on a CPU).
    bits = x.float().contiguous().view(torch.int32)
    magnitude = torch.where((bits & 0x7F800000) == 0, torch.zeros_like(bits), bits & 0x7FFFFFFF)
    amax = _blocks(magnitude.view(torch.float32), scheme.block_shape, origin).amax(dim=-1).amax(dim=-2)
    return torch.where(torch.isfinite(amax), amax, torch.full_like(amax, float("nan")))


def combine_amax(*parts: torch.Tensor) -> torch.Tensor:
    """The amax of a block from its holders' partial amax (same shape): their maximum;
    NaN (a poisoned part) propagates. Exact: ``max`` is associative and commutative."""
    if not parts:
        raise ValueError("combine_amax needs at least one partial amax")
    out = parts[0]
    for p in parts[1:]:
        out = torch.maximum(out, p)
    return out


def scales_from_amax(amax: torch.Tensor, fmt: object) -> torch.Tensor:
    """Per-block scales from per-block amax (NaN: poisoned block): float32 scale_inv for
    fp8-block, uint8 E8M0 codes for mxfp8 (module docstring, step 3)."""
    scheme = as_scheme(fmt)
    amax = amax.float()
    bad = torch.isnan(amax)
    if scheme.kind == "fp8-block":
        # A tensor divisor, not a Python scalar: CUDA torch turns division by a CPU scalar into
        # a multiplication by its rounded reciprocal, one bit off the IEEE quotient at times.
        scale = torch.clamp_min(amax / torch.full_like(amax, E4M3_MAX), FP32_MIN_NORMAL)
        scale = torch.where(amax == 0, torch.ones_like(scale), scale)
        nan = torch.full_like(amax, 0).view(torch.int32).fill_(_F32_NAN_BITS).view(torch.float32)
        return torch.where(bad, nan, scale)
    biased = (torch.where(bad, torch.zeros_like(amax), amax).view(torch.int32) >> 23) & 0xFF
    code = torch.clamp(biased - E4M3_EMAX, 0, 254)  # amax is 0 or normal: biased >= 1
    code = torch.where(amax == 0, torch.full_like(code, E8M0_BIAS), code)
    code = torch.where(bad, torch.full_like(code, E8M0_NAN), code)
    return code.to(torch.uint8)


def _poisoned(scales: torch.Tensor, kind: str) -> torch.Tensor:
    return torch.isnan(scales) if kind == "fp8-block" else scales == E8M0_NAN


def poisoned(scales: torch.Tensor, fmt: object) -> torch.Tensor:
    """Which blocks of ``scales`` (the format's scale dtype) are poisoned (NaN / Inf held)."""
    return _poisoned(scales, as_scheme(fmt).kind)


def quantize_with_scales(x: torch.Tensor, scales: torch.Tensor, fmt: object,
                         origin: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """``x`` (a box at ``origin`` inside its first block) as float8_e4m3fn, with the given
    per-block ``scales`` (shape :func:`scale_shape`): bit-identical to the same elements of
    a whole-block quantization with those scales."""
    scheme = as_scheme(fmt)
    _check_origin(origin, scheme.block_shape)
    want = scale_shape(x.shape, scheme, origin)
    if tuple(scales.shape) != want or scales.dtype != scheme.scale_dtype:
        raise ValueError(f"scales must be {scheme.scale_dtype} of shape {want} for a box of shape "
                         f"{tuple(x.shape)} at origin {origin}, got {scales.dtype} {tuple(scales.shape)}")
    max_elements = _slab_elements(x)
    if x.numel() <= max_elements:
        return _quantize(x, scales, scheme, origin)
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    for e, b, o in _slabs(x.shape, scheme.block_shape, origin, max_elements):
        out[e] = _quantize(x[e], scales[b], scheme, o)
    return out


def _quantize(x: torch.Tensor, scales: torch.Tensor, scheme: BlockScheme, origin: tuple[int, int]) -> torch.Tensor:
    values, _ = _widen(x)
    # Broadcast each block's scale over its elements in the blocked view (no per-element copy).
    blocks = _blocks(values, scheme.block_shape, origin)
    per = scales.unsqueeze(-1).unsqueeze(-3)  # [..., nbr, 1, nbc, 1]
    if scheme.kind == "fp8-block":
        y = blocks / per
    else:
        # 2 ** (127 - code) built from its exponent bits: exact, normal for codes 0..254.
        y = blocks * ((254 - per.to(torch.int32)).clamp(0, 254) << 23).view(torch.float32)
    q = torch.clamp(y, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(_poisoned(per, scheme.kind), torch.full_like(q, E4M3_NAN), q)
    rows, cols = x.shape[-2:]
    q = q.reshape(*x.shape[:-2], q.shape[-4] * q.shape[-3], q.shape[-2] * q.shape[-1])
    return q[..., origin[0] : origin[0] + rows, origin[1] : origin[1] + cols].contiguous().view(torch.float8_e4m3fn)


def check_scales(scales: torch.Tensor, fmt: object, tensor: str = "tensor",
                 block_offset: Sequence[int] | None = None) -> None:
    """Raise :class:`NonFiniteBlockError` for the first poisoned block of ``scales``;
    ``block_offset`` is the index of ``scales[0, ..., 0]`` in the tensor's scale grid."""
    scheme = as_scheme(fmt)
    bad = _poisoned(scales, scheme.kind)
    if not bool(bad.any()):
        return
    idx = tuple(int(i) for i in torch.nonzero(bad)[0].tolist())
    if block_offset is not None:
        idx = tuple(i + int(o) for i, o in zip(idx, block_offset, strict=True))
    br, bc = scheme.block_shape
    offsets = (*idx[:-2], idx[-2] * br, idx[-1] * bc)
    lengths = (*(1,) * (len(idx) - 2), br, bc)
    raise NonFiniteBlockError(tensor, idx, (offsets, lengths))


def quantize_reference(x: torch.Tensor, fmt: object, *, name: str = "tensor",
                       nonfinite: str = "raise") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the whole tensor ``x`` (>= 2-D, blocks of its last two dims): returns the
    float8_e4m3fn tensor and its scales (module docstring). ``nonfinite="raise"`` raises
    :class:`NonFiniteBlockError` naming ``name`` and the block; ``"propagate"`` returns the
    poisoned blocks as the kernels write them."""
    if nonfinite not in ("raise", "propagate"):
        raise ValueError(f"nonfinite must be 'raise' or 'propagate', got {nonfinite!r}")
    if x.dim() < 2:
        raise ValueError(f"tensor {name!r}: block quantization needs >= 2 dims, got {tuple(x.shape)}")
    scales = scales_from_amax(block_amax(x, fmt), fmt)
    if nonfinite == "raise":
        check_scales(scales, fmt, name)
    return quantize_with_scales(x, scales, fmt), scales


def dequantize_reference(q: torch.Tensor, scales: torch.Tensor, fmt: object) -> torch.Tensor:
    """float32 ``q * scale`` block by block (what an inference engine computes)."""
    scheme = as_scheme(fmt)
    per = _expand(scales, q.shape, scheme.block_shape, (0, 0))
    factor = per if scheme.kind == "fp8-block" else (per.to(torch.int32) - E8M0_BIAS).float().exp2()
    return q.float() * factor


def e4m3_bits_reference(y: torch.Tensor) -> torch.Tensor:
    """float32 ``y`` in [-448, 448] to E4M3 bytes by integer arithmetic, round to nearest
    even: the kernel's software cast (used where Triton has no exact conversion: its CPU
    interpreter), checked here against torch's ``.to(float8_e4m3fn)``."""
    b = y.float().contiguous().view(torch.int32)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    # Normal E4M3 (|y| >= 2**-6): drop 20 mantissa bits rounding to even, rebias 127 -> 7.
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal E4M3: multiples of 2**-9; adding 2**23 rounds to an integer (to even).
    sub = ((a.view(torch.float32) * 512.0 + 8388608.0) - 8388608.0).to(torch.int32)
    code = torch.where(a >= 0x3C800000, normal, sub)
    return (sign | code).to(torch.uint8)
