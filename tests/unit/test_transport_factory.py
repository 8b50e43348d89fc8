"""The transport factory: a transport of a backend, over a real gloo process group."""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from elastic_refit.membership.comm import probe_runtime

from elastic_refit.transport import create_transport, make_transport
from elastic_refit.transport.backend import Backend
from elastic_refit.transport.c10d import NONBLOCKING_TIMEOUT_ENV, bound_torch_nccl_waits
from elastic_refit.transport.factory import probe_nccl4py
from elastic_refit.transport.protocol import P2POp, Transport


def _gloo_group(store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=10))


def test_make_transport_wraps_a_gloo_group_with_the_capabilities_asked_for():
    store = dist.HashStore()
    group = _gloo_group(store, 0, 1)
    transport = make_transport("gloo", group, 0, 1, timeout_s=7.0, store=store)
    assert isinstance(transport, Transport)
    caps = transport.capabilities
    assert (caps.backend, caps.device, caps.can_shrink, caps.can_grow) == (Backend.GLOO, torch.device("cpu"),
                                                                         False, False)
    assert transport.timeout_s == 7.0 and (transport.rank, transport.world_size) == (0, 1)
    assert transport.vote(True) and not transport.vote(False)
    transport.close()
    assert transport.aborted


def test_make_transport_refuses_what_a_backend_cannot_do():
    store = dist.HashStore()
    group = _gloo_group(store, 0, 1)
    with pytest.raises(ValueError, match=r"cannot grow.*can_grow=True"):
        make_transport(Backend.GLOO, group, 0, 1, store=store, can_grow=True)
    with pytest.raises(ValueError, match="backend must be one of gloo, nccl, nccl4py, got 'mpi'"):
        make_transport("mpi", group, 0, 1)
    with pytest.raises(ValueError, match="rank 1 is outside a world of 1"):
        make_transport("gloo", group, 1, 1, store=store)


def test_create_transport_builds_a_world_that_moves_bytes():
    """Two ranks (threads of this process) over one store: a message each way, then the vote."""
    store = dist.HashStore()
    results: dict[int, object] = {}

    def rank_main(rank: int) -> None:
        try:
            transport = create_transport("gloo", dist.PrefixStore("factory", store), rank, 2, timeout_s=10.0)
            sent = torch.full((64,), rank + 1, dtype=torch.uint8)
            got = torch.zeros(64, dtype=torch.uint8)
            peer = 1 - rank
            works = transport.post((P2POp("send", sent, peer, 3), P2POp("recv", got, peer, 3)))
            for work in works:
                transport.wait(work, peer, "exchange")
            results[rank] = (int(got.sum()), transport.vote(True), transport.capabilities.backend)
            transport.close()
        except BaseException as exc:  # reported below, with the rank
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert results == {0: (64 * 2, True, Backend.GLOO), 1: (64 * 1, True, Backend.GLOO)}


def test_create_transport_refuses_an_unknown_backend_before_building():
    with pytest.raises(ValueError, match="backend must be one of"):
        create_transport("ucc", dist.HashStore(), 0, 1)


def test_the_nccl4py_probe_is_what_the_communicator_manager_sees():
    probe = probe_nccl4py()
    support = probe_runtime()
    assert (support.nccl4py_version, support.nccl4py_nccl_version, support.nccl4py_shrink,
            support.nccl4py_grow) == (probe.version, probe.nccl_version, probe.shrink, probe.grow)
    if probe.version is None:  # absent (this CPU machine): it offers nothing
        assert (probe.nccl_version, probe.shrink, probe.grow) == (None, False, False)


@pytest.mark.parametrize(("seconds", "value"), [(30.0, "29"), (20, "19"), (4.5, "4"), (1.5, "1"), (0.2, "1")])
def test_torch_nccl_waits_are_bounded_by_the_transport_timeout(monkeypatch, seconds, value):
    # torch compares whole elapsed seconds with ">": a value of ceil(s) - 1 fires at s.
    monkeypatch.delenv(NONBLOCKING_TIMEOUT_ENV, raising=False)
    assert bound_torch_nccl_waits(seconds) == int(value)
    assert os.environ[NONBLOCKING_TIMEOUT_ENV] == value


def test_a_bound_already_set_is_kept_and_bad_input_refused(monkeypatch):
    monkeypatch.setenv(NONBLOCKING_TIMEOUT_ENV, "7")
    assert bound_torch_nccl_waits(30.0) == 7  # torch read it once already, or the user chose it
    with pytest.raises(ValueError, match="seconds must be > 0, got 0"):
        bound_torch_nccl_waits(0)
