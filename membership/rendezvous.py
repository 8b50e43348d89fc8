"""An epoch's rendezvous around a communicator's build: the arrival barrier every rank
passes first (``arrived/{member}/{incarnation}`` in the epoch's store), the store gloo's
connect reads its peers' addresses from, and the confirmation after gloo's connect
(``built/{member}/{incarnation}``).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

from elastic_refit.membership.client import Compare, Delete, EtcdClient
from elastic_refit.membership.errors import StoreTimeout
from elastic_refit.membership.store import EtcdStore
from elastic_refit.membership.view import MembershipView

from elastic_refit.errors import brief

__all__ = ["GLOO_PASSIVE_CONNECT_FACTOR", "GlooRendezvousStore", "arrive", "barrier_complete", "confirm_built"]

# gloo's connect (torch 2.13 and 2.11) waits for a peer that is to connect to it (the passive
# side of a pair) five times its context timeout, whatever that peer does meanwhile: measured
# 3 s -> 15 s, 4 s -> 20 s, 6 s -> 30 s, and gloo leaves the listener's timeout a "TODO". A
# build therefore gives gloo a fifth of the connect bound, and its rendezvous store keeps the
# whole bound for the address keys (see GlooRendezvousStore).
GLOO_PASSIVE_CONNECT_FACTOR = 5
# etcd allows 128 operations per transaction by default (--max-txn-ops): a barrier of more
# ranks cannot be read in one transaction, and falls back to leaving by a plain delete.
_MAX_BARRIER_COMPARES = 100


class GlooRendezvousStore(EtcdStore):
    """The store a gloo group is built with: its waits keep this store's own timeout. gloo
    passes its context timeout to every wait for a peer's address key, and a build sets that
    to a fifth of the connect bound (``GLOO_PASSIVE_CONNECT_FACTOR``): an address written a
    moment late by a slow but live peer must not fail the build."""

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        super().wait(keys)


def arrive(client: EtcdClient, store: EtcdStore, mine: str, keys: list[str]) -> None:
    """Mark this rank's arrival at the epoch's rendezvous (``mine``, one of ``keys``, in
    ``store``) and wait until every rank of the epoch is there (up to the store's timeout;
    given up at once when its cancel says a newer epoch supersedes this one). gloo's
    connect cannot be cancelled: a rank that left it half done (it had written its
    address, then gave up for a newer epoch) stranded a peer in connect for the whole
    rendezvous timeout, and every later epoch waited for that peer. Past this barrier every
    peer is here and connects within moments."""
    store.set(mine, "1")
    consistent = len(keys) <= _MAX_BARRIER_COMPARES
    while True:
        try:
            store.wait(keys)
        except StoreTimeout:
            if consistent and barrier_complete(client, store, keys, leave=mine):
                return  # everyone arrived before we could leave: a peer may be connecting
            if not consistent:  # peers still waiting must not count this rank as arrived
                with contextlib.suppress(Exception):
                    store.delete_key(mine)
            raise
        # The wait read the keys one by one: a peer may have left between two reads.
        # Pass only on one consistent read, so that a peer's leave (below) and our pass
        # can never both happen.
        if not consistent or barrier_complete(client, store, keys):
            return


def barrier_complete(client: EtcdClient, store: EtcdStore, keys: list[str], *, leave: str | None = None) -> bool:
    """One transaction: are all ``keys`` there (at one revision)? With ``leave``, delete
    that key in the same transaction when they are not: a rank leaves the barrier only
    when no peer can have seen it complete, so nobody is stranded in gloo's connect (a
    peer that passed it waits there for the whole connect timeout)."""
    res = client.txn([Compare(store._k(k), "create", ">", 0) for k in keys], [],
                     [Delete(store._k(leave))] if leave is not None else [])
    return res.succeeded


def confirm_built(store: EtcdStore, view: MembershipView, member_id: str, *, ok: bool, log: Any) -> None:
    """After this rank's gloo connect: say so in ``store`` (the epoch's, its waits bounded by
    the transport timeout and given up once a newer epoch dropped a participant) and, when
    it succeeded, wait until every rank of the epoch is through its own, before anyone may
    tear the group down.

    A rank that finished gloo's connectFullMesh and moved on to a newer epoch at once
    (aborting the group) stranded a peer still inside it: gloo's connect retries a vanished
    listener for ~15 s, past the timeout it was given and uncancellable, and every later
    epoch's rendezvous waited for that peer (restart<ttl and restart+kill trials recovered
    in 15.3-15.6 s, 2026-12-02/03). A rank whose connect failed says so too ("0"), so nobody
    waits for it. Past this point the group is complete on every rank; a wait that fails is
    logged (``comm.build.unconfirmed``), the group itself is fine."""
    keys = [f"built/{m.member_id}/{m.incarnation}" for m in view.members]
    try:
        store.set(keys[view.rank_of(member_id)], "1" if ok else "0")
        if ok:
            store.wait(keys)
    except Exception as exc:  # peers that never finish re-form later
        log.warning("comm.build.unconfirmed", epoch=view.epoch, error=brief(exc) if str(exc) else type(exc).__name__)
