"""A layout as bytes: how a side publishes its self-described layout (to etcd).

The encoding is the layout's columns (``numpy.save`` of each, in a fixed order) behind a
JSON header with the tensors and buffer names, zlib-compressed (the columns are small
integers and compress ~10x). Decoding rebuilds the identical ``Layout``: the same rows and
so the same fingerprint, which the reader checks against the one it asked for, so a layout
fetched by fingerprint is the layout that fingerprint names or an error.

An inference side may also declare its destination formats (``TensorFormats``: FP8 weights
with block scales). They travel with its layout, in format 2 (``ERL2``: the header adds the
formats' canonical JSON), under :func:`described_fingerprint`, which covers both: two sides
with the same pieces but other formats are two descriptions. A side without quantized
formats encodes as format 1 (``ERL1``), byte for byte as before formats existed, under its
layout's own fingerprint; decoding reads both.

A side kept as rules (``SymbolicLayout``) encodes as format 3 (``ERL3``): its tensors, buffer
and piece rules (and formats, if any) as JSON, O(tensors) bytes whatever the number of ranks,
under the same described fingerprint as its explicit layout (the fingerprints agree).
``decode_described`` reads all three (an ``ERL3`` side as its explicit layout);
``decode_symbolic_described`` gives an ``ERL3`` side's rules.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
import zlib

import numpy as np

from elastic_refit.layout.core import Layout, LogicalTensor
from elastic_refit.layout.formats import TensorFormats

__all__ = ["decode_described", "decode_layout", "decode_symbolic", "decode_symbolic_described",
           "described_fingerprint", "encode_layout", "encode_symbolic"]

_MAGIC = b"ERL1"  # elastic-refit layout, format 1: the layout alone
_MAGIC_FORMATS = b"ERL2"  # format 2: the layout and its destination formats
_COLUMNS = ("buffer_rank", "buffer_name", "buffer_shape", "buffer_ndim", "buffer_dtype", "piece_tensor",
            "piece_buffer", "piece_offsets", "piece_lengths", "piece_local_offsets", "piece_local_lengths")


def described_fingerprint(layout: Layout, formats: TensorFormats | None = None) -> str:
    """The fingerprint of a side's self-description: ``layout.fingerprint`` when no tensor
    is quantized (the fingerprint sides had before formats), else a hash of the layout's
    fingerprint and ``formats.fingerprint``."""
    if not formats:
        return layout.fingerprint
    digest = hashlib.sha256(f"layout={layout.fingerprint};formats={formats.fingerprint}".encode())
    return digest.hexdigest()[:32]


def encode_layout(layout: Layout, formats: TensorFormats | None = None) -> bytes:
    """``layout`` (and its destination ``formats``) as bytes (see the module docstring);
    :func:`decode_described` inverts it, :func:`decode_layout` gives the layout alone."""
    if formats is not None and not isinstance(formats, TensorFormats):
        raise ValueError(f"formats must be a TensorFormats, got {formats!r}")
    head = {
        "tensors": [[t.name, list(t.shape), t.dtype] for t in layout.tensors],
        "buffer_names": list(layout.buffer_names),
        "fingerprint": layout.fingerprint,
    }
    if formats:
        formats.check(layout.tensors)
        head["formats"] = formats.to_json()
        head["described"] = described_fingerprint(layout, formats)
    header = json.dumps(head).encode()
    body = io.BytesIO()
    for name in _COLUMNS:
        np.save(body, np.ascontiguousarray(getattr(layout, name)), allow_pickle=False)
    raw = struct.pack("<I", len(header)) + header + body.getvalue()
    return (_MAGIC_FORMATS if formats else _MAGIC) + zlib.compress(raw, level=1)


def decode_described(blob: bytes, fingerprint: str | None = None) -> tuple[Layout, TensorFormats]:
    """The layout and destination formats ``blob`` encodes (no formats: an empty
    ``TensorFormats``); ``ValueError`` if it is not an encoded layout or (with
    ``fingerprint``, a :func:`described_fingerprint`) describes another side than the one
    asked for."""
    magic = bytes(blob[:4]) if isinstance(blob, bytes | bytearray | memoryview) else b""
    if magic == _MAGIC_SYMBOLIC:
        symbolic, formats = decode_symbolic_described(blob, fingerprint)
        return symbolic.to_layout(), formats
    if magic not in (_MAGIC, _MAGIC_FORMATS):
        raise ValueError("not an encoded layout (bad magic)")
    try:
        raw = zlib.decompress(bytes(blob[4:]))
        (header_len,) = struct.unpack_from("<I", raw)
        header = json.loads(raw[4 : 4 + header_len])
        body = io.BytesIO(raw[4 + header_len :])
        columns = {name: np.load(body, allow_pickle=False) for name in _COLUMNS}
        layout = Layout(
            tensors=tuple(LogicalTensor(name, tuple(shape), dtype) for name, shape, dtype in header["tensors"]),
            buffer_names=tuple(header["buffer_names"]),
            **columns,
        )
        formats = TensorFormats.from_json(header["formats"]) if magic == _MAGIC_FORMATS else TensorFormats()
        if magic == _MAGIC_FORMATS:
            formats.check(layout.tensors)
    except (zlib.error, struct.error, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"corrupt encoded layout: {exc}") from None
    if layout.fingerprint != header["fingerprint"]:
        raise ValueError(f"encoded layout has fingerprint {layout.fingerprint}, expected {header['fingerprint']}")
    described = described_fingerprint(layout, formats)
    if described != header.get("described", layout.fingerprint) or (fingerprint is not None and described != fingerprint):
        raise ValueError(f"encoded layout has fingerprint {described}, expected "
                         f"{fingerprint or header.get('described', layout.fingerprint)}")
    return layout, formats


def decode_layout(blob: bytes, fingerprint: str | None = None) -> Layout:
    """The layout ``blob`` encodes (its formats, if any, dropped); ``ValueError`` as
    :func:`decode_described` raises it."""
    return decode_described(blob, fingerprint)[0]


# ---- symbolic layouts (ERL3): the rules, O(tensors) bytes whatever the ranks -----------------
_MAGIC_SYMBOLIC = b"ERL3"


def encode_symbolic(layout, formats: TensorFormats | None = None) -> bytes:
    """A ``SymbolicLayout`` (and its destination ``formats``) as bytes: its tensors, buffer
    rules and piece rules as JSON (and its explicit part, if any, as an ``ERL1`` blob),
    zlib-compressed, under its described fingerprint; :func:`decode_symbolic_described`
    inverts it. Kilobytes for a model's presets at any scale."""
    if formats is not None and not isinstance(formats, TensorFormats):
        raise ValueError(f"formats must be a TensorFormats, got {formats!r}")
    explicit = encode_layout(layout.explicit).hex() if layout.explicit is not None else None
    head = {"tensors": [[t.name, list(t.shape), t.dtype] for t in layout.tensors],
            "buffers": [b.to_json() for b in layout.buffers], "rules": [r.to_json() for r in layout.rules],
            "explicit": explicit, "fingerprint": layout.fingerprint}
    if formats:
        formats.check(layout.tensors)
        head["formats"] = formats.to_json()
        head["described"] = described_fingerprint(layout, formats)
    return _MAGIC_SYMBOLIC + zlib.compress(json.dumps(head, separators=(",", ":")).encode(), level=6)


def decode_symbolic(blob: bytes, fingerprint: str | None = None):
    """The ``SymbolicLayout`` ``blob`` encodes (its formats, if any, dropped); ``ValueError``
    as :func:`decode_symbolic_described` raises it."""
    return decode_symbolic_described(blob, fingerprint)[0]


def decode_symbolic_described(blob: bytes, fingerprint: str | None = None):
    """The ``SymbolicLayout`` and destination formats ``blob`` (``ERL3``) encodes; ``ValueError``
    if it is not one, or (with ``fingerprint``, a :func:`described_fingerprint`) it describes
    another side than the one asked for."""
    from elastic_refit.layout.symbolic import BufferRule, PieceRule, SymbolicLayout

    if bytes(blob[:4]) != _MAGIC_SYMBOLIC:
        raise ValueError("not an encoded symbolic layout (bad magic)")
    try:
        head = json.loads(zlib.decompress(bytes(blob[4:])))
        layout = SymbolicLayout(
            tensors=tuple(LogicalTensor(name, tuple(shape), dtype) for name, shape, dtype in head["tensors"]),
            buffers=tuple(BufferRule.from_json(b) for b in head["buffers"]),
            rules=tuple(PieceRule.from_json(r) for r in head["rules"]),
            explicit=decode_layout(bytes.fromhex(head["explicit"])) if head["explicit"] else None)
        formats = TensorFormats.from_json(head["formats"]) if "formats" in head else TensorFormats()
        formats.check(layout.tensors)
    except (zlib.error, KeyError, TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"corrupt encoded symbolic layout: {exc}") from None
    if layout.fingerprint != head["fingerprint"]:
        raise ValueError(f"encoded symbolic layout has fingerprint {layout.fingerprint}, expected "
                         f"{head['fingerprint']}")
    described = described_fingerprint(layout, formats)
    want = fingerprint or head.get("described", layout.fingerprint)
    if described != want or described != head.get("described", layout.fingerprint):
        raise ValueError(f"encoded symbolic layout has fingerprint {described}, expected {want}")
    return layout, formats
