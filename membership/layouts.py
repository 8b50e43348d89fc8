"""Self-described layouts on etcd, content-addressed by fingerprint.

Each member publishes the layout of its own side (opaque bytes here: the runtime encodes
and decodes them: a side's rules, ``ERL3``, kilobytes whatever the number of ranks, or its
pieces, ``ERL1``/``ERL2``) and names its fingerprint in its member record; peers fetch a
layout the first time a record names it. Keys (under ``/elastic-refit/{job}/``):

- ``layouts/{fingerprint}`` -> ``{num_bytes, num_chunks, sha256}``, written last;
- ``layouts/{fingerprint}/{i}`` -> chunk ``i`` (etcd refuses requests over 1.5 MiB by default).

A layout never changes under its fingerprint, so writers skip one that exists and readers
cache forever. Writes are fenced on the writer's own lease (a member that lost its
registration cannot publish), but a layout outlives its writer: other members may reference
the same fingerprint.
"""

from __future__ import annotations

import hashlib
import json

from elastic_refit.membership.client import Compare, EtcdClient, Put
from elastic_refit.membership.errors import MembershipError
from elastic_refit.membership.keys import JobKeys
from elastic_refit.membership.service import Membership

__all__ = ["CHUNK_BYTES", "MAX_LAYOUT_BYTES", "LayoutStore", "LayoutUnavailable"]

CHUNK_BYTES = 1 << 20
MAX_LAYOUT_BYTES = 256 << 20  # etcd's default backend quota is 2 GiB; a side's layout must stay far below


class LayoutUnavailable(MembershipError):
    """A member record names a layout that is not (yet, or any longer) in etcd, or whose
    bytes do not match their header."""


class LayoutStore:
    """Reads and fenced writes of one job's layouts."""

    def __init__(self, client: EtcdClient, job: str, chunk_bytes: int = CHUNK_BYTES) -> None:
        if not 0 < chunk_bytes <= CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in (0, {CHUNK_BYTES}], got {chunk_bytes!r}")
        self.client = client
        self.keys = JobKeys(job)
        self.chunk_bytes = chunk_bytes

    def put(self, membership: Membership, fingerprint: str, blob: bytes) -> bool:
        """Publish ``blob`` as layout ``fingerprint``; False if it was there already.
        ``ValueError`` for a layout too large for etcd."""
        if len(blob) > MAX_LAYOUT_BYTES:
            raise ValueError(f"layout {fingerprint} encodes to {len(blob)} bytes, more than the "
                             f"{MAX_LAYOUT_BYTES} a job's etcd can hold per layout")
        header_key = self.keys.layout(fingerprint)
        if self.client.get(header_key) is not None:
            return False
        size = self.chunk_bytes
        chunks = [blob[i : i + size] for i in range(0, len(blob), size)] or [b""]
        for index, chunk in enumerate(chunks):
            membership.fenced_put(self.keys.layout_chunk(fingerprint, index), chunk)
        header = json.dumps({"num_bytes": len(blob), "num_chunks": len(chunks),
                             "sha256": hashlib.sha256(blob).hexdigest()}).encode()
        # Created once: a concurrent writer of the same fingerprint wrote the same chunks.
        result = self.client.txn([membership.ownership_compare(), Compare(header_key, "create", "==", 0)],
                                 [Put(header_key, header)])
        if not result.succeeded:
            membership.check()
        return result.succeeded

    def get(self, fingerprint: str) -> bytes:
        """The bytes of layout ``fingerprint``; :class:`LayoutUnavailable` if it is missing
        or incomplete."""
        header_kv = self.client.get(self.keys.layout(fingerprint))
        if header_kv is None:
            raise LayoutUnavailable(f"layout {fingerprint} is not in etcd (a member names it before publishing it, "
                                    "or its keys were deleted)")
        header = json.loads(header_kv.value)
        result = self.client.get_prefix(self.keys.layout(fingerprint) + "/")
        chunks = sorted((kv.key, kv.value) for kv in result.kvs)
        blob = b"".join(value for _, value in chunks)
        if len(chunks) != header["num_chunks"] or hashlib.sha256(blob).hexdigest() != header["sha256"]:
            raise LayoutUnavailable(f"layout {fingerprint} in etcd is incomplete or corrupt: {len(chunks)} of "
                                    f"{header['num_chunks']} chunks, {len(blob)} of {header['num_bytes']} bytes")
        return blob
