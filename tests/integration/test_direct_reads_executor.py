"""Direct reads inside the executor, on real gloo processes: same-host messages read from the
source's memory (a CPU double maps files where the IPC transport maps GPU memory,
``tests/integration/shm_direct.py``), the rest over gloo, every byte checked against the
pattern, refit after refit.

Two domains on one host is the case that needs the order: the inference replicas fan out to
each other what they received over the network in the same refit, so those reads may start
only once the network exchange delivered it (read before, they copied the sentinel the
buffers held). Through a ``FaultyTransport`` (every chaos member with a fault has one) the
ranks still read directly: a wrapped rank moving its same-host messages through gloo while
its peers read them directly would leave both ends waiting."""

from __future__ import annotations

import pytest

from elastic_refit.layout import parse_spec
from elastic_refit.layout.core import Topology
from elastic_refit.plan import Phase, PlanOptions, make_plan
from elastic_refit.testing.processes import run_local_world
from elastic_refit.testing.specs import tiny_spec_json
from elastic_refit.transport.direct import split_direct
from elastic_refit.transport.schedule import build_rank_schedule

from .shm_direct import shm_direct_rank

SPEC = tiny_spec_json(2)


def _intra_recv(domains) -> tuple[dict[int, int], int]:
    """Per rank the intra-domain bytes it receives, and the fan-out bytes among them."""
    import json

    spec = parse_spec(json.loads(SPEC))
    plan = make_plan(spec.source, spec.destination, Topology(domains), PlanOptions(bucket_bytes=4096, relay="off"))
    per_rank, fan_out = {}, 0
    for r in range(4):
        schedule = build_rank_schedule(plan, r)
        per_rank[r] = schedule.bytes_by_kind()["intra_recv"]
        recvs = split_direct(schedule, frozenset(set(range(4)) - {r})).recvs
        fan_out += sum(m.nbytes for phase, _, m in recvs if phase == int(Phase.FAN_OUT))
    return per_rank, fan_out


@pytest.mark.parametrize(("domains", "faulty"), [((0, 0, 1, 1), False), ((0, 0, 1, 1), True), ((0, 0, 0, 0), True)],
                         ids=["two-domains", "two-domains-faulty-transport", "one-domain-faulty-transport"])
def test_direct_reads_land_every_byte_fan_outs_after_the_network(tmp_path, domains, faulty):
    intra, fan_out = _intra_recv(domains)
    assert (fan_out > 0) == (len(set(domains)) == 2)  # the case has what it tests
    results = run_local_world(shm_direct_rank, 4, (SPEC, domains, str(tmp_path), 2, faulty), timeout_s=120)
    assert all(r.ok for r in results), [(r.rank, r.error_type, r.error[-1500:]) for r in results if not r.ok]
    for r in results:
        assert r.value["problems"] == [], r.value["problems"]
        assert r.value["direct_recv_bytes"] == intra[r.rank]
        assert (r.value["fenced"] > 0) == (intra[r.rank] > 0)  # copies that read a peer are fenced
