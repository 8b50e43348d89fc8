"""The Prometheus adapter maps runtime events onto refit_* metrics without member labels."""

from __future__ import annotations

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
