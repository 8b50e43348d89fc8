"""A layout as bytes: how a side publishes its self-described layout (to etcd).

The encoding is the layout's columns (``numpy.save`` of each, in a fixed order) behind a
JSON header with the tensors and buffer names, zlib-compressed (the columns are small
integers and compress ~10x). Decoding rebuilds the identical ``Layout``: the same rows and
so the same fingerprint, which the reader checks against the one it asked for, so a layout
fetched by fingerprint is the layout that fingerprint names or an error.
"""

from __future__ import annotations

import io
import json
import struct
import zlib

import numpy as np

from elastic_refit.layout.core import Layout, LogicalTensor

__all__ = ["decode_layout", "encode_layout"]

_MAGIC = b"ERL1"  # elastic-refit layout, format 1
_COLUMNS = ("buffer_rank", "buffer_name", "buffer_shape", "buffer_ndim", "buffer_dtype", "piece_tensor",
            "piece_buffer", "piece_offsets", "piece_lengths", "piece_local_offsets", "piece_local_lengths")


def encode_layout(layout: Layout) -> bytes:
    """``layout`` as bytes (see the module docstring); ``decode_layout`` inverts it."""
    header = json.dumps({
        "tensors": [[t.name, list(t.shape), t.dtype] for t in layout.tensors],
        "buffer_names": list(layout.buffer_names),
        "fingerprint": layout.fingerprint,
    }).encode()
    body = io.BytesIO()
    for name in _COLUMNS:
        np.save(body, np.ascontiguousarray(getattr(layout, name)), allow_pickle=False)
    raw = struct.pack("<I", len(header)) + header + body.getvalue()
    return _MAGIC + zlib.compress(raw, level=1)


def decode_layout(blob: bytes, fingerprint: str | None = None) -> Layout:
    """The layout ``blob`` encodes; ``ValueError`` if it is not an encoded layout or (with
    ``fingerprint``) encodes another layout than the one asked for."""
    if not isinstance(blob, bytes | bytearray | memoryview) or bytes(blob[:4]) != _MAGIC:
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
    except (zlib.error, struct.error, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"corrupt encoded layout: {exc}") from None
    if layout.fingerprint != header["fingerprint"] or (fingerprint is not None and layout.fingerprint != fingerprint):
        raise ValueError(f"encoded layout has fingerprint {layout.fingerprint}, expected "
                         f"{fingerprint or header['fingerprint']}")
    return layout
