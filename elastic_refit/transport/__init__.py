"""The transport seam and the data path: the ``Transport`` protocol, its torch c10d
implementation, and the executor that runs one rank's share of a plan over it.

Public API (imported on first use, so that ``import elastic_refit.transport.protocol``
stays light)::

    Transport, Backend          the protocol (elastic_refit.transport.protocol)
    make_transport              the factory: a transport of a backend over a communicator the caller built
    create_transport            ... or over one it builds from a store (every rank of the world calls it)
    C10dTransport               gloo / NCCL process group: C10dTransport.create(store, rank, world_size, ...)
    Executor, ExecutorOptions   Executor(plan, transport, ExecutorOptions(...)).run(source, destination)
    TransferReport              what Executor.run returns
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic_refit._lazy import lazy_exports

if TYPE_CHECKING:
    from elastic_refit.transport.c10d import C10dTransport
    from elastic_refit.transport.executor import Executor, ExecutorOptions, TransferReport
    from elastic_refit.transport.factory import create_transport, make_transport
    from elastic_refit.transport.protocol import Backend, Transport

__all__ = ["Backend", "C10dTransport", "Executor", "ExecutorOptions", "TransferReport", "Transport",
           "create_transport", "make_transport"]

_EXPORTS = {
    "Backend": "elastic_refit.transport.protocol",
    "Transport": "elastic_refit.transport.protocol",
    "C10dTransport": "elastic_refit.transport.c10d",
    "Executor": "elastic_refit.transport.executor",
    "ExecutorOptions": "elastic_refit.transport.executor",
    "TransferReport": "elastic_refit.transport.executor",
    "create_transport": "elastic_refit.transport.factory",
    "make_transport": "elastic_refit.transport.factory",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
