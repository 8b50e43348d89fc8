"""Self-described layouts in a real etcd: chunked, content-addressed, written once, verified."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from elastic_refit.membership.client import EtcdClient
from elastic_refit.membership.keys import JobKeys
from elastic_refit.membership.layouts import LayoutStore, LayoutUnavailable
from elastic_refit.membership.service import Membership
from elastic_refit.membership.view import MemberRecord

from elastic_refit.layout import LayoutBuilder, add_sharded_tensor, decode_layout, encode_layout
from elastic_refit.runtime.layouts import LayoutCache

pytestmark = pytest.mark.etcd


CHUNK_BYTES = 16 << 10  # small chunks, so a small layout spans several


def big_layout():
    """Thousands of uneven pieces: its encoding spans several chunks."""
    b = LayoutBuilder()
    for i in range(200):
        add_sharded_tensor(b, f"layers.{i}.w", (97 + i, 13), "bfloat16", np.arange(64).reshape(8, 8),
                           ["S(0)", "S(1)"])
    return b.build()


def test_a_layout_larger_than_a_chunk_round_trips_and_is_written_once(etcd_server):
    job = f"job-{uuid.uuid4().hex[:8]}"
    layout = big_layout()
    blob = encode_layout(layout)
    assert len(blob) > 2 * CHUNK_BYTES, len(blob)
    with pytest.raises(ValueError, match=r"^chunk_bytes must be in \(0, 1048576\], got 0$"):
        LayoutStore(None, job, chunk_bytes=0)  # type: ignore[arg-type]
    with EtcdClient([etcd_server.endpoint]) as client:
        record = MemberRecord("trainer", "t0", "inc0", "h", "d", "cpu", layout_rank=0, layout=layout.fingerprint)
        with Membership(client, job, record) as membership:
            store = LayoutStore(client, job, chunk_bytes=CHUNK_BYTES)
            assert store.put(membership, layout.fingerprint, blob) is True
            assert store.put(membership, layout.fingerprint, blob) is False  # content-addressed: once
            keys = JobKeys(job)
            assert client.count_prefix(keys.layout(layout.fingerprint) + "/") == -(-len(blob) // CHUNK_BYTES)
            # Another rank (a fresh cache) fetches it by fingerprint and gets the same layout.
            fetched = LayoutCache(store).get(layout.fingerprint)
            assert fetched.fingerprint == layout.fingerprint and fetched.num_pieces == layout.num_pieces
            assert decode_layout(store.get(layout.fingerprint)).fingerprint == layout.fingerprint
            with pytest.raises(LayoutUnavailable, match=r"^layout 0123abcd is not in etcd"):
                LayoutCache(store).get("0123abcd")
            # A chunk lost (or tampered with) is detected, never decoded into another layout.
            client.delete(keys.layout_chunk(layout.fingerprint, 1))
            with pytest.raises(LayoutUnavailable, match=r"in etcd is incomplete or corrupt"):
                store.get(layout.fingerprint)
