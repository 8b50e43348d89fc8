"""Destination formats: how the inference side stores each logical tensor.

A layout describes logical tensors in their training dtype (BF16); a destination format says
how the destination holds one of them. Three formats:

``bf16``
    Passthrough (the default): the destination holds the tensor in its logical dtype.
``fp8-block128``
    The DeepSeek-V3 checkpoint layout as vLLM loads it: a ``float8_e4m3fn`` weight of the
    tensor's shape plus a ``float32`` ``weight_scale_inv`` of shape
    ``[..., ceil(rows / 128), ceil(cols / 128)]`` (one scale per 128 x 128 block of the last
    two dims; leading dims, such as stacked experts, are batch dims). ``weight = fp8 *
    scale_inv`` block by block. ``fp8-block{N}`` (N a power of two in 16..512) is the same
    with N x N blocks, for tests and other checkpoints.
``mxfp8``
    OCP Microscaling (MX v1.0) MXFP8 E4M3: blocks of 32 consecutive elements along the
    input (last) dim, one E8M0 shared exponent per block, stored as its ``uint8`` code
    (``2 ** (code - 127)``; 255 is NaN) in ``weight_scale`` of shape ``[..., rows,
    ceil(cols / 32)]``.

A destination that holds a tensor in another floating dtype than its source (BF16 where the
trainer keeps FP32) says so in its layout, not here: the refit casts it on the senders
(``elastic_refit.layout.casts``), and ``bf16`` above then means the destination's own dtype.
A cast and a quantized format are not combined (the planner refuses it).

:class:`TensorFormats` is the per-tensor declaration of one destination side: tensors it does
not name are ``bf16``. It is kept beside the destination :class:`Layout` (spec files,
presets and self-described layouts declare it) rather than inside it: a layout describes
logical tensors and pieces only (a quantized tensor's buffers are declared in its logical
dtype), so its fingerprint never depends on formats, and plans fold
:attr:`TensorFormats.fingerprint` (``""`` when nothing is quantized) into their own.

Plain integer arithmetic here (the layout layer imports no torch); the quantizer is
``elastic_refit.kernels.quantize``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BF16",
    "E4M3_MAX",
    "FORMAT_NAMES",
    "FP8_BLOCK128",
    "MXFP8",
    "DestinationFormat",
    "TensorFormats",
    "parse_format",
]

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
FORMAT_NAMES = ("bf16", "fp8-block128", "mxfp8")
MX_BLOCK = 32  # OCP MX v1.0: elements per shared scale
_QUANTIZABLE_DTYPES = ("bfloat16", "float16", "float32")

_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16", "none": "bf16", "passthrough": "bf16",
    "fp8": "fp8-block128", "fp8_e4m3": "fp8-block128", "fp8-e4m3": "fp8-block128",
    "fp8-block": "fp8-block128", "fp8_block128": "fp8-block128",
    "mxfp8": "mxfp8", "mx-fp8": "mxfp8", "mxfp8_e4m3": "mxfp8", "mxfp8-e4m3": "mxfp8",
}
_BLOCK_RE = re.compile(r"^fp8[-_]block(\d+)$")


@dataclass(frozen=True, slots=True)
class DestinationFormat:
    """One destination format by canonical name (``parse_format`` accepts aliases).

    Derived fields: ``kind`` (``"bf16"``, ``"fp8-block"``, ``"mxfp8"``) and ``block_shape``
    (rows, cols) of one scale block, ``None`` for ``bf16``.
    """

    name: str = "bf16"
    kind: str = field(init=False)
    block_shape: tuple[int, int] | None = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"destination format must be a string, got {self.name!r}")
        if self.name == "bf16":
            kind, block = "bf16", None
        elif self.name == "mxfp8":
            kind, block = "mxfp8", (1, MX_BLOCK)
        else:
            m = _BLOCK_RE.match(self.name)
            n = int(m.group(1)) if m else 0
            if not m or self.name != f"fp8-block{n}" or n & (n - 1) or not 16 <= n <= 512:
                raise ValueError(
                    f"unknown destination format {self.name!r}; known: {', '.join(FORMAT_NAMES)} "
                    f"(or fp8-block{{N}}, N a power of two in 16..512)"
                )
            kind, block = "fp8-block", (n, n)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "block_shape", block)

    def __str__(self) -> str:
        return self.name

    # ---- what the destination stores ------------------------------------------------------
    @property
    def quantized(self) -> bool:
        return self.kind != "bf16"

    @property
    def element_dtype(self) -> str | None:
        """Dtype of the stored weight; ``None`` (the logical dtype) for ``bf16``."""
        return "float8_e4m3fn" if self.quantized else None

    @property
    def scale_dtype(self) -> str | None:
        """``float32`` scale_inv (fp8-block), ``uint8`` E8M0 codes (mxfp8), ``None`` (bf16)."""
        return {"fp8-block": "float32", "mxfp8": "uint8"}.get(self.kind)

    @property
    def scale_itemsize(self) -> int:
        return {"fp8-block": 4, "mxfp8": 1}.get(self.kind, 0)

    @property
    def scale_suffix(self) -> str:
        """What the checkpoint appends to the weight's name for its scales: DeepSeek-V3's
        ``weight_scale_inv``, MX checkpoints' ``weight_scale``."""
        return {"fp8-block": "_scale_inv", "mxfp8": "_scale"}.get(self.kind, "")

    def scale_name(self, tensor: str) -> str:
        """The scale tensor's name beside ``tensor`` (``x.weight`` -> ``x.weight_scale_inv``)."""
        if not self.quantized:
            raise ValueError(f"format {self.name!r} has no scales (tensor {tensor!r})")
        return tensor + self.scale_suffix

    def check_tensor(self, tensor: str, shape: Sequence[int], dtype: str = "bfloat16") -> None:
        """``ValueError`` naming ``tensor`` unless this format can hold it."""
        if not self.quantized:
            return
        if len(shape) < 2:
            raise ValueError(
                f"tensor {tensor!r}: format {self.name} quantizes blocks of the last two dims, "
                f"but the tensor has shape {tuple(shape)}"
            )
        if dtype not in _QUANTIZABLE_DTYPES:
            raise ValueError(
                f"tensor {tensor!r}: format {self.name} quantizes {', '.join(_QUANTIZABLE_DTYPES)} "
                f"tensors, not {dtype}"
            )

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of the scale tensor of a tensor of ``shape`` (``()`` for ``bf16``)."""
        if not self.quantized:
            return ()
        self.check_tensor("?", shape)
        br, bc = self.block_shape  # type: ignore[misc]
        *lead, rows, cols = (int(s) for s in shape)
        return (*lead, -(-rows // br), -(-cols // bc))

    def nbytes(self, shape: Sequence[int], itemsize: int = 2) -> int:
        """Bytes the destination holds for a tensor of ``shape``: elements plus scales
        (``itemsize`` is the logical dtype's, used for ``bf16``)."""
        numel = math.prod(int(s) for s in shape)
        if not self.quantized:
            return numel * itemsize
        return numel + math.prod(self.scale_shape(shape)) * self.scale_itemsize

    def block_box(
        self, offsets: Sequence[int], lengths: Sequence[int]
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The box of scale blocks that the element box ``offsets``/``lengths`` touches
        (leading dims unchanged; the last two in whole blocks, partial ones included)."""
        if not self.quantized:
            raise ValueError(f"format {self.name!r} has no blocks")
        if len(offsets) != len(lengths) or len(offsets) < 2:
            raise ValueError(f"block_box needs a box of rank >= 2, got {offsets}+{lengths}")
        out_o, out_l = list(offsets[:-2]), list(lengths[:-2])
        for o, n, b in zip(offsets[-2:], lengths[-2:], self.block_shape, strict=True):  # type: ignore[arg-type]
            first, end = o // b, -(-(o + n) // b)
            out_o.append(first)
            out_l.append(end - first if n else 0)
        return tuple(out_o), tuple(out_l)

    def is_block_aligned(
        self, offsets: Sequence[int], lengths: Sequence[int], shape: Sequence[int]
    ) -> bool:
        """Whether the box covers whole blocks of a tensor of ``shape``: it starts on a block
        boundary and ends on one or at the tensor's edge (a partial edge block is whole)."""
        if not self.quantized:
            return True
        for o, n, s, b in zip(offsets[-2:], lengths[-2:], shape[-2:], self.block_shape, strict=True):  # type: ignore[arg-type]
            if o % b or ((o + n) % b and o + n != s):
                return False
        return True


BF16 = DestinationFormat("bf16")
FP8_BLOCK128 = DestinationFormat("fp8-block128")
MXFP8 = DestinationFormat("mxfp8")


def parse_format(text: object) -> DestinationFormat:
    """A format from its name or an alias (``"fp8"``, ``"fp8_e4m3"``: fp8-block128;
    ``"bfloat16"``, ``"none"``: bf16); the CLI's ``--destination-format`` parser."""
    if isinstance(text, DestinationFormat):
        return text
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"destination format must be a name like 'fp8-block128', got {text!r}")
    key = text.strip().lower()
    return DestinationFormat(_ALIASES.get(key, key))


@dataclass(frozen=True, slots=True)
class TensorFormats:
    """Destination format per logical tensor; tensors not named are ``bf16``.

    ``entries`` are ``(tensor name, format)`` pairs; they are stored sorted by name with
    ``bf16`` entries dropped, so equal declarations in any order (and with or without
    explicit ``bf16``) are equal and share a fingerprint. Build one from a mapping with
    :meth:`from_mapping`.
    """

    entries: tuple[tuple[str, DestinationFormat], ...] = ()
    _index: dict[str, DestinationFormat] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        seen: dict[str, DestinationFormat] = {}
        for item in self.entries:
            try:
                name, fmt = item
            except (TypeError, ValueError):
                raise ValueError(f"format entries must be (tensor, format) pairs, got {item!r}") from None
            if not isinstance(name, str) or not name:
                raise ValueError(f"format entry names must be non-empty strings, got {name!r}")
            fmt = parse_format(fmt)
            if name in seen and seen[name] != fmt:
                raise ValueError(f"tensor {name!r} declared with formats {seen[name]} and {fmt}")
            seen[name] = fmt
        object.__setattr__(
            self, "entries", tuple(sorted((n, f) for n, f in seen.items() if f.quantized))
        )
        object.__setattr__(self, "_index", dict(self.entries))

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, DestinationFormat | str]) -> TensorFormats:
        return cls(tuple(mapping.items()))

    @classmethod
    def uniform(cls, names: Sequence[str], fmt: DestinationFormat | str) -> TensorFormats:
        """``fmt`` for every tensor in ``names``."""
        fmt = parse_format(fmt)
        return cls(tuple((n, fmt) for n in names))

    def of(self, tensor: str) -> DestinationFormat:
        """The format of ``tensor`` (``bf16`` unless declared)."""
        return self._index.get(tensor, BF16)

    def as_dict(self) -> dict[str, DestinationFormat]:
        return dict(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[str]:
        return (n for n, _ in self.entries)

    def __contains__(self, tensor: object) -> bool:
        return tensor in self._index

    def __bool__(self) -> bool:
        return bool(self.entries)

    @property
    def fingerprint(self) -> str:
        """Stable hash of the declarations; ``""`` when nothing is quantized, so a plan of
        an all-``bf16`` destination fingerprints as it did before formats existed."""
        if not self.entries:
            return ""
        digest = hashlib.sha256(self.to_json().encode())
        return digest.hexdigest()[:32]

    def check(self, tensors: Sequence[Any]) -> None:
        """``ValueError`` naming the tensor for a declaration of an unknown tensor or of one
        the format cannot hold. ``tensors``: the layout's ``LogicalTensor`` objects."""
        by_name = {t.name: t for t in tensors}
        for name, fmt in self.entries:
            t = by_name.get(name)
            if t is None:
                raise ValueError(f"format {fmt} declared for tensor {name!r}, which the layout lacks")
            fmt.check_tensor(name, t.shape, t.dtype)

    def to_json(self) -> str:
        """Canonical JSON ``{"tensor": "format"}`` (what a side publishes beside its layout)."""
        return json.dumps({n: f.name for n, f in self.entries}, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> TensorFormats:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"malformed tensor formats JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"tensor formats JSON must be an object, got {type(data).__name__}")
        return cls.from_mapping(data)

