"""The Prometheus adapter maps runtime events onto refit_* metrics without member labels."""

from __future__ import annotations

import inspect

import pytest

prom = pytest.importorskip("prometheus_client")

from elastic_refit.runtime.metrics import RefitMetrics  # noqa: E402


def test_events_become_metrics():
    registry = prom.CollectorRegistry()
    metrics = RefitMetrics(registry)
    base = {"role": "inference", "member_id": "i0", "incarnation": "x"}
    metrics("refit.transfer.done", {**base, "seconds": 0.5, "network_recv_bytes": 1000, "local_bytes": 24,
                                    "network_send_bytes": 0, "intra_recv_bytes": 0})
    metrics("refit.attempt.failed", {**base, "error": "boom"})
    metrics("refit.epoch.entered", {**base, "epoch": 7})
    metrics("refit.version.serving", {**base, "version": 3})
    metrics("refit.unrelated.event", base)
    value = registry.get_sample_value
    assert value("refit_bytes_total", {"direction": "recv", "path": "network"}) == 1000
    assert value("refit_bytes_total", {"direction": "recv", "path": "local"}) == 24
    assert value("refit_transfer_seconds_count", {"role": "inference"}) == 1
    assert value("refit_attempts_total", {"role": "inference", "outcome": "failed"}) == 1
    assert value("refit_epoch") == 7
    assert value("refit_serving_version") == 3
    text = prom.generate_latest(registry).decode()
    assert "i0" not in text and "member_id" not in text  # no member ids as labels


def test_detached_is_set_while_rejoining_and_when_out_for_good():
    registry = prom.CollectorRegistry()
    metrics = RefitMetrics(registry)
    base = {"role": "inference", "member_id": "i0"}
    metrics("refit.member.detached", {**base, "reason": "lease expired"})
    assert registry.get_sample_value("refit_detached") == 1
    metrics("refit.member.rejoined", {**base, "previous_incarnation": "x"})
    assert (registry.get_sample_value("refit_detached"), registry.get_sample_value("refit_rejoins_total")) == (0, 1)
    metrics("fault.detected", {**base, "kind": "attempt_failed"})
    assert registry.get_sample_value("refit_detached") == 0
    metrics("fault.detected", {**base, "kind": "membership_lost", "error": "etcd went back"})
    assert registry.get_sample_value("refit_detached") == 1


def test_metrics_are_served_on_the_address_given_and_loopback_by_default():
    import urllib.request

    metrics = RefitMetrics(registry=prom.CollectorRegistry())
    metrics("refit.version.committed", {"role": "trainer"})
    host, port = metrics.serve("127.0.0.1:0")
    assert host == "127.0.0.1" and port > 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert 'refit_versions_committed_total{role="trainer"} 1.0' in reply.read().decode()
    assert inspect.signature(RefitMetrics.serve).parameters["address"].default.startswith("127.0.0.1:")
    with pytest.raises(ValueError, match=r"^metrics address must look like host:port, got '9464'$"):
        metrics.serve("9464")
    with pytest.raises(ValueError, match=r"^metrics address '127.0.0.1:" + str(port) + "' cannot be bound: "):
        metrics.serve(f"127.0.0.1:{port}")  # taken
