"""What tests, demos and benchmarks need, in the spirit of ``torch.testing``.

Nothing in the library imports this package. It holds:

- ``EtcdServer`` / ``EtcdCluster``: real etcd on free loopback ports, stopped by pid;
- ``run_local_world``: one function on N spawned processes sharing a rendezvous store;
- ``MemberSpec`` / ``run_member``: one member of a local elastic job (the one member loop
  of the demo, the chaos suite and the runtime tests);
- ``allocate`` / ``fill_pieces`` / ``check_pieces``: deterministic, position-dependent
  pattern data that a destination can verify bit-exactly;
- ``FaultyTransport`` and ``fault_hooks``: the one fault seam (a fault-injecting
  transport wrapper, and hooks at the runtime's named phases, given to a context);
- ``read_logs``: the JSON event logs of member processes;
- ``tiny_spec_json`` / ``demo_spec``: the small models of the chaos trials, the soak and
  the demo.

It never imports ``elastic_refit.chaos``: the chaos harness builds on this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic_refit._lazy import lazy_exports

_EXPORTS = {
    "EtcdCluster": "elastic_refit.testing.etcd",
    "EtcdServer": "elastic_refit.testing.etcd",
    "EtcdServerError": "elastic_refit.testing.etcd",
    "RankResult": "elastic_refit.testing.processes",
    "run_local_world": "elastic_refit.testing.processes",
    "allocate": "elastic_refit.testing.pattern",
    "check_pieces": "elastic_refit.testing.pattern",
    "fill_pieces": "elastic_refit.testing.pattern",
    "read_logs": "elastic_refit.testing.logs",
    "FaultyTransport": "elastic_refit.testing.faults",
    "fault_hooks": "elastic_refit.testing.faults",
    "MemberSpec": "elastic_refit.testing.job",
    "run_member": "elastic_refit.testing.job",
    "demo_spec": "elastic_refit.testing.specs",
    "tiny_spec_json": "elastic_refit.testing.specs",
}

__all__ = [
    "EtcdCluster",
    "EtcdServer",
    "EtcdServerError",
    "FaultyTransport",
    "MemberSpec",
    "RankResult",
    "allocate",
    "check_pieces",
    "demo_spec",
    "fault_hooks",
    "fill_pieces",
    "read_logs",
    "run_local_world",
    "run_member",
    "tiny_spec_json",
]

if TYPE_CHECKING:
    from elastic_refit.testing.etcd import EtcdCluster, EtcdServer, EtcdServerError
    from elastic_refit.testing.faults import FaultyTransport, fault_hooks
    from elastic_refit.testing.job import MemberSpec, run_member
    from elastic_refit.testing.logs import read_logs
    from elastic_refit.testing.pattern import allocate, check_pieces, fill_pieces
    from elastic_refit.testing.processes import RankResult, run_local_world
    from elastic_refit.testing.specs import demo_spec, tiny_spec_json


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
