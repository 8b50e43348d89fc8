"""A ``torch.distributed.Store`` on etcd, scoped to one epoch: ``store/{epoch}/...``.

Communicators of an epoch rendezvous here (gloo exchanges addresses, NCCL its unique
id), so a rebuild never needs a separate TCPStore host that could itself fail, and keys
of an old epoch can never be confused with the new one.

Keep a Python reference to the store for as long as a process group uses it: if only C++
holds it, the pybind trampoline loses its Python half and every call fails.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
from elastic_refit.membership.client import EtcdClient
from elastic_refit.membership.epoch_kv import EpochKV


class EtcdStore(EpochKV, dist.Store):
    """A ``torch.distributed.Store`` under ``/elastic-refit/{job}/store/{epoch}/{namespace}``
    (the operations are :class:`~membership.epoch_kv.EpochKV`'s).

    Implements set, get, add, compare_set, wait, check, delete_key, num_keys,
    multi_get and multi_set; ``get`` and ``wait`` block up to the store timeout and then
    raise :class:`~membership.errors.StoreTimeout` (a ``TimeoutError``).
    """

    def __init__(self, client: EtcdClient, job: str, epoch: int, *, namespace: str = "",
                 timeout: timedelta = timedelta(seconds=30), cancel: Callable[[], bool] | None = None):
        dist.Store.__init__(self)
        EpochKV.__init__(self, client, job, epoch, namespace=namespace, timeout=timeout, cancel=cancel)

    def clone(self) -> EtcdStore:
        """This store itself. c10d clones a group's store for a group it derives from it
        (``ProcessGroupNCCL.shrink``); a clone is another connection to the same keys, and
        this store's etcd client is already shared by every thread. Returning ``self`` also
        keeps the store's Python half alive for as long as the caller holds the parent's
        (a new Python store held only by C++ would lose it). Torch forwards this override
        only where its Python store binding does: :func:`membership.comm_paths.probe_runtime`
        checks that before a torch NCCL group is shrunk."""
        return self

    # The timeout lives in the torch Store, where torch's own calls (set_timeout) change it.
    def _set_default_timeout(self, timeout: timedelta) -> None:
        self.set_timeout(timeout)

    def _default_timeout(self) -> timedelta:
        return self.timeout
