"""The one place that makes a transport of a backend.

Whoever owns communicators (``membership.comm``: build, shrink, grow, rebuild; the test
toolkit's local worlds) asks here for a :class:`~elastic_refit.transport.protocol.Transport`
and never names a concrete one:

- :func:`make_transport` wraps a communicator the caller built (a c10d process group for
  gloo and torch NCCL, an nccl4py communicator);
- :func:`create_transport` builds the communicator of a world from a store, then wraps it;
- :func:`with_direct_reads` routes a transport by peer: CUDA IPC between ranks of one host,
  the transport for everything else; :func:`release_deferred_mappings` unmaps what a
  faulted one could not unmap yet (its owner calls it once the communicator is aborted);
- :func:`gloo_group` and :func:`nccl_group` build the c10d process groups an owner keeps
  across epochs (with the options membership's lifecycle needs);
- the nccl4py lifecycle (:func:`probe_nccl4py`, :func:`init_nccl4py`,
  :func:`shrink_nccl4py`, :func:`grow_nccl4py`, :func:`nccl4py_parent_state`) for owners of
  nccl4py communicators.

Concrete transports are imported on first use, so importing this module loads neither
them nor nccl4py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from elastic_refit.transport.backend import Backend
from elastic_refit.transport.protocol import Transport

__all__ = ["create_transport", "gloo_device", "gloo_group", "grow_nccl4py", "init_nccl4py", "make_transport",
           "nccl4py_parent_state", "nccl_group", "probe_nccl4py", "release_deferred_mappings", "shrink_nccl4py",
           "with_direct_reads"]


def make_transport(backend: Backend | str, communicator: Any, rank: int, world_size: int, *,
                   timeout_s: float = 30.0, device: torch.device | None = None, store: Any = None,
                   can_shrink: bool = False, can_grow: bool = False) -> Transport:
    """A transport over ``communicator``, already built by the caller, which keeps owning
    it (a transport never destroys its communicator).

    ``backend`` gloo or nccl: ``communicator`` is a c10d process group; ``store`` is the
    store it was built with, kept alive as long as the transport (a Python store collected
    while C++ uses it fails every call); the device is the group's (CPU for gloo, the
    current CUDA device for NCCL) and ``device`` is ignored. nccl4py: ``communicator`` is an
    initialised nccl4py communicator on ``device`` (default: the current CUDA device).
    ``can_shrink`` / ``can_grow`` become the transport's :class:`Capabilities`; a c10d
    group cannot grow (``ValueError``). ``timeout_s`` bounds every wait and the vote."""
    kind = Backend.parse(backend)
    if kind is Backend.NCCL4PY:
        from elastic_refit.transport.nccl import NcclTransport

        return NcclTransport(communicator, rank, world_size, timeout_s=timeout_s, device=device,
                             can_shrink=can_shrink, can_grow=can_grow)
    if can_grow:
        raise ValueError(f"a {kind.value} process group cannot grow (only nccl4py communicators can), "
                         f"got can_grow={can_grow!r}")
    from elastic_refit.transport.c10d import C10dTransport

    return C10dTransport(communicator, rank, world_size, backend=kind, timeout_s=timeout_s, store=store,
                         can_shrink=can_shrink)


def create_transport(backend: Backend | str, store: Any, rank: int, world_size: int, *,
                     timeout_s: float = 30.0, init_timeout_s: float = 60.0) -> Transport:
    """Build the communicator of a world of ``world_size`` ranks over ``store`` (a
    ``torch.distributed.Store``; every rank calls this with the same one) and wrap it. GPU
    backends use the current CUDA device; ``init_timeout_s`` bounds an nccl4py
    communicator's initialisation (a c10d group's build is bounded by ``timeout_s``)."""
    kind = Backend.parse(backend)
    if kind is Backend.NCCL4PY:
        from elastic_refit.transport.nccl import NcclTransport

        return NcclTransport.create(store, rank, world_size, timeout_s=timeout_s, init_timeout_s=init_timeout_s)
    from elastic_refit.transport.c10d import C10dTransport

    return C10dTransport.create(store, rank, world_size, backend=kind, timeout_s=timeout_s)


def with_direct_reads(transport: Transport, store: Any, hosts: Sequence[str], *,
                      device: torch.device | str | None = None) -> Transport:
    """``transport`` routed by peer: ranks on this rank's host (``hosts[r]``: the host of
    rank r of the world) read each other's memory over CUDA IPC on ``device`` (default: the
    current CUDA device), everything else goes through ``transport``. ``store`` is the
    epoch's store (IPC handles are shared there). The result owns ``transport``: closing
    or aborting it releases every mapping, then closes or aborts ``transport``. Without a
    peer on this host, ``transport`` itself, unless that moves other tensors than
    ``device``'s (a gloo base: the result stages GPU buffers through host memory)."""
    from elastic_refit.transport.ipc import IpcTransport, release_deferred, same_host_peers

    if len(hosts) != transport.world_size:
        raise ValueError(f"hosts names {len(hosts)} ranks, the world has {transport.world_size}")
    # A new epoch's communicator exists: the previous one was shrunk or aborted, so the
    # work that held a faulted transport's mappings has ended.
    release_deferred()
    peers = same_host_peers(hosts, transport.rank)
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if not peers and transport.device.type == dev.type:
        return transport
    return IpcTransport(transport, store, peers, dev)


def release_deferred_mappings(timeout_s: float = 0.0) -> int:
    """Unmap the CUDA IPC mappings a faulted transport deferred (its communicator may have
    held a kernel stuck on a dead peer, and unmapping synchronises the device), waiting up
    to ``timeout_s`` for that work to end; the communicator's owner calls it after aborting
    the communicator. Returns how many are still deferred. Loads nothing when no direct
    reads ran in this process."""
    import sys

    ipc = sys.modules.get("elastic_refit.transport.ipc")
    return ipc.release_deferred(timeout_s) if ipc is not None else 0


# ------------------------------------------------------------------ c10d process groups
def gloo_group(store: Any, rank: int, world_size: int, *, timeout_s: float, interface: str | None = None) -> Any:
    """A ``ProcessGroupGloo`` of ``world_size`` ranks over ``store``, its context timeout
    ``timeout_s`` (its connect waits up to five times that for a passive peer), its device
    bound to ``interface`` (None: gloo's default device)."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout_s)
    options._devices = [gloo_device(interface)]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


_gloo_devices: dict[str | None, Any] = {}
_gloo_devices_lock = threading.Lock()


def gloo_device(interface: str | None = None) -> Any:
    """This process's gloo transport device bound to ``interface`` (None: gloo's default),
    made on first use and shared by every group of the process, so its one listening socket
    is the process's, like gRPC's channel pool.

    Why not one per group (torch's default): gloo's C++ state keeps a group's device, and so
    its listener, alive for good once a send or recv of the group timed out and the group was
    dropped (a member whose peer stalled on etcd past its lease; reproduced with two
    processes, 2026-12-05), so every such fault left one more listening socket behind. A
    shared device leaves none: later groups keep using it."""
    import torch.distributed as dist

    with _gloo_devices_lock:
        device = _gloo_devices.get(interface)
        if device is None:
            device = (dist.ProcessGroupGloo.create_device(interface=interface) if interface
                      else dist.ProcessGroupGloo.create_default_device())
            _gloo_devices[interface] = device
        return device


def nccl_group(store: Any, rank: int, world_size: int, *, timeout: timedelta, device: torch.device,
               wait_bound_s: float | None = None) -> Any:
    """A ``ProcessGroupNCCL`` of ``world_size`` ranks over ``store``, non-blocking where
    torch lets it be (so it can be aborted mid-init), connected eagerly on ``device``;
    ``wait_bound_s`` bounds torch's own waits on it (init, the end of a group that connects
    a new pair of ranks: see ``transport.c10d.bound_torch_nccl_waits``)."""
    from elastic_refit.transport.c10d import nccl_process_group

    return nccl_process_group(store, rank, world_size, timeout=timeout, device=device, wait_bound_s=wait_bound_s)


# ------------------------------------------------------------------ nccl4py lifecycle
def probe_nccl4py() -> Any:
    """What the installed nccl4py offers (``Nccl4pySupport``: version, the libnccl it
    loaded, shrink, grow); empty when it is absent. Never raises."""
    from elastic_refit.transport.nccl import probe_nccl4py as probe

    return probe()


def init_nccl4py(store: Any, rank: int, world_size: int, timeout_s: float,
                 cancel: Callable[[], bool] | None = None) -> Any:
    """A new nccl4py communicator of ``world_size`` ranks, settled; rank 0 publishes the
    unique id in ``store``. ``cancel()`` true gives up early (``TransportAborted``); a
    half-made communicator is aborted."""
    from elastic_refit.transport.nccl import init_communicator

    return init_communicator(store, rank, world_size, timeout_s, cancel)


def nccl4py_parent_state(communicator: Any, timeout_s: float) -> int:
    """Whether ``communicator`` can be shrunk or grown from: its NCCL state once quiescent
    (0: ready; an error state is final, see :func:`~elastic_refit.transport.nccl.parent_state`)."""
    from elastic_refit.transport.nccl import parent_state

    return parent_state(communicator, timeout_s)


def shrink_nccl4py(parent: Any, excluded: Sequence[int], *, abort: bool, timeout_s: float,
                   abort_timeout_s: float, cancel: Callable[[], bool] | None = None,
                   logger: Any = None) -> Any:
    """``parent`` shrunk to the ranks not in ``excluded``, settled within ``timeout_s``
    (``abort``: a peer died, in-flight work is aborted). The parent stays the caller's."""
    from elastic_refit.transport.nccl import shrink_communicator

    return shrink_communicator(parent, excluded, abort=abort, timeout_s=timeout_s,
                               abort_timeout_s=abort_timeout_s, cancel=cancel, logger=logger)


def grow_nccl4py(parent: Any | None, num_ranks: int, rank: int, store: Any, *, timeout_s: float,
                 abort_timeout_s: float, cancel: Callable[[], bool] | None = None,
                 logger: Any = None) -> Any:
    """A communicator of ``num_ranks`` grown from ``parent`` (None on a newcomer, which
    reads the grow root's id from ``store``), settled within ``timeout_s``."""
    from elastic_refit.transport.nccl import grow_communicator

    return grow_communicator(parent, num_ranks, rank, store, timeout_s=timeout_s,
                             abort_timeout_s=abort_timeout_s, cancel=cancel, logger=logger)
