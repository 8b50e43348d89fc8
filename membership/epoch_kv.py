"""An epoch's rendezvous keys on etcd (``store/{epoch}/...``), without torch.

:class:`EpochKV` holds the key-value operations of :class:`~membership.store.EtcdStore`
(the ``torch.distributed.Store`` that communicators rendezvous through): a process that
only writes or checks an attempt's ``done`` keys, such as a host agent or the
control-plane simulation, uses it without loading torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from datetime import timedelta

from elastic_refit.membership.client import Compare, EtcdClient, Get, KeyValue, Put
from elastic_refit.membership.errors import StoreTimeout
from elastic_refit.membership.keys import JobKeys

_POLL_MIN_S = 0.002
_POLL_MAX_S = 0.05
_GETS_PER_TXN = 64  # etcd refuses transactions of more than --max-txn-ops (128) operations


class EpochKV:
    """Key-value rendezvous under ``/elastic-refit/{job}/store/{epoch}/{namespace}``.

    Implements set, get, add, compare_set, wait, check, delete_key, num_keys,
    multi_get and multi_set; ``get`` and ``wait`` block up to the store timeout and then
    raise :class:`~membership.errors.StoreTimeout` (a ``TimeoutError``).
    """

    def __init__(self, client: EtcdClient, job: str, epoch: int, *, namespace: str = "",
                 timeout: timedelta = timedelta(seconds=30), cancel: Callable[[], bool] | None = None):
        # Checked while waiting: a rendezvous for a superseded epoch can never complete (a
        # member that left will not write its keys), so it gives up at once.
        self._cancel = cancel
        if namespace and not namespace.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"namespace must be alphanumeric with '_' or '-', got {namespace!r}")
        self._client = client
        self.epoch = epoch
        self.prefix = JobKeys(job).store(epoch) + (f"{namespace}/" if namespace else "")
        self._set_default_timeout(timeout)

    def _set_default_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def _default_timeout(self) -> timedelta:
        return self._timeout

    def _k(self, key: str) -> str:
        return self.prefix + key

    def etcd_key(self, key: str) -> str:
        """The etcd key that store key ``key`` lives at (for a write in another transaction)."""
        return self._k(key)

    def _timeout_s(self, override: timedelta | None = None) -> float:
        t = override if override is not None else self._default_timeout()
        seconds = t.total_seconds()
        return seconds if seconds > 0 else float("inf")

    # -- the torch.distributed.Store interface, for EtcdStore ---------------
    def set(self, key: str, value) -> None:
        self._client.put(self._k(key), bytes(value) if not isinstance(value, str) else value)

    def get(self, key: str) -> bytes:
        self.wait([key])
        kv = self._client.get(self._k(key))
        if kv is None:  # deleted between wait and get
            raise StoreTimeout(f"store key {self._k(key)!r} vanished after appearing")
        return kv.value

    def add(self, key: str, value: int) -> int:
        """Atomically add ``value`` to the integer at ``key`` (absent counts as 0)."""
        k = self._k(key)
        while True:
            kv = self._client.get(k)
            current = int(kv.value) if kv is not None else 0
            new = current + int(value)
            guard = Compare(k, "mod", "==", kv.mod_revision if kv is not None else 0)
            if self._client.txn([guard], [Put(k, str(new).encode())]).succeeded:
                return new

    def compare_set(self, key: str, expected_value, desired_value) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``b''``: if absent)."""
        k = self._k(key)
        expected = bytes(expected_value) if not isinstance(expected_value, str) else expected_value.encode()
        desired = bytes(desired_value) if not isinstance(desired_value, str) else desired_value.encode()
        guard = (Compare(k, "version", "==", 0) if expected == b""
                 else Compare(k, "value", "==", expected))
        res = self._client.txn([guard], [Put(k, desired)], [Get(k)])
        if res.succeeded:
            return desired
        current = res.gets[0] if res.gets else ()
        return current[0].value if current else expected

    def check(self, keys: list[str]) -> bool:
        return not self._missing(keys)

    def read(self, keys: list[str], known: Mapping[str, KeyValue] | None = None) -> dict[str, KeyValue]:
        """The keys of ``keys`` that are set, with their values and revisions, in a few
        transactions of reads (one etcd request per ``_GETS_PER_TXN`` keys, not one per key:
        a coordinator reads every participant's done key, a participant every plan key).
        ``known``: etcd key -> KeyValue as a watch of the store holds them, looked up
        instead of reading etcd."""
        if known is not None:
            return {key: known[self._k(key)] for key in keys if self._k(key) in known}
        found: dict[str, KeyValue] = {}
        for start in range(0, len(keys), _GETS_PER_TXN):
            chunk = keys[start:start + _GETS_PER_TXN]
            res = self._client.txn([], [Get(self._k(key)) for key in chunk], idempotent=True)
            found.update((key, kvs[0]) for key, kvs in zip(chunk, res.gets, strict=True) if kvs)
        return found

    def _missing(self, keys: list[str]) -> list[str]:
        """The keys of ``keys`` not set yet."""
        found = self.read(keys)
        return [key for key in keys if key not in found]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = self._timeout_s(timeout)
        deadline = time.monotonic() + limit
        pending = list(keys)
        delay = _POLL_MIN_S
        while pending:
            pending = self._missing(pending)
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise StoreTimeout(
                    f"store keys {[self._k(k) for k in pending]} not set within {limit}s "
                    f"(epoch {self.epoch})"
                )
            if self._cancel is not None and self._cancel():
                raise StoreTimeout(f"store wait for {[self._k(k) for k in pending]} cancelled: "
                                   f"epoch {self.epoch} was superseded")
            # Short polls first: rendezvous peers usually arrive within milliseconds.
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, _POLL_MAX_S)

    def delete_key(self, key: str) -> bool:
        return self._client.delete(self._k(key))

    def num_keys(self) -> int:
        return self._client.count_prefix(self.prefix)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Every key's value, waiting for those not set yet (read together: one request
        when all are there, as after a wait for them)."""
        found = self.read(keys)
        while len(found) < len(set(keys)):
            self.wait([key for key in keys if key not in found])
            found = self.read(keys)  # a key may vanish between wait and read: wait again
        return [found[key].value for key in keys]

    def multi_set(self, keys: list[str], values: list) -> None:
        """Set every key, in one request per ``_GETS_PER_TXN`` keys (was one per key)."""
        if len(keys) != len(values):
            raise ValueError(f"multi_set needs one value per key, got {len(keys)} keys and {len(values)} values")
        puts = [Put(self._k(k), v.encode() if isinstance(v, str) else bytes(v)) for k, v in zip(keys, values, strict=True)]
        for start in range(0, len(puts), _GETS_PER_TXN):
            # Plain puts, no guard: applying them twice is applying them once, so retried.
            self._client.txn([], puts[start:start + _GETS_PER_TXN], idempotent=True)

    def purge(self) -> int:
        """Delete every key of this store's prefix; returns how many were removed."""
        return self._client.delete_prefix(self.prefix)
