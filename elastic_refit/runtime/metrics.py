"""Optional Prometheus metrics fed from the runtime's events.

``RefitMetrics`` is an ``on_event`` listener for ``ElasticRefit``. Names carry the
``refit_`` prefix and their unit (seconds, bytes); labels are low-cardinality (role, kind,
outcome), never member ids. ``prometheus_client`` is imported lazily: without it,
constructing ``RefitMetrics`` raises a clear error and nothing else changes.
"""

from __future__ import annotations

from typing import Any


class RefitMetrics:
    """Counters and histograms of one process; register them on ``registry`` (default: the
    client's global one) and serve them with :meth:`serve` on the address you choose."""

    def __init__(self, registry: Any | None = None) -> None:
        try:
            import prometheus_client as prom
        except ImportError:
            raise RuntimeError("metrics need the prometheus_client package (pip install prometheus_client)") from None
        self.registry = registry if registry is not None else prom.REGISTRY
        kw = {"registry": registry} if registry is not None else {}
        self.transfer_seconds = prom.Histogram("refit_transfer_seconds", "Wall time of one rank's transfer",
                                               ["role"], **kw)
        self.plan_seconds = prom.Histogram("refit_plan_seconds", "Time to build a plan", ["role"], **kw)
        self.bytes = prom.Counter("refit_bytes", "Bytes moved by this rank", ["direction", "path"], **kw)
        self.versions = prom.Counter("refit_versions_committed", "Versions this process saw committed",
                                     ["role"], **kw)
        self.attempts = prom.Counter("refit_attempts", "Refit attempts by outcome", ["role", "outcome"], **kw)
        self.faults = prom.Counter("refit_faults", "Faults detected by kind", ["kind"], **kw)
        self.epoch = prom.Gauge("refit_epoch", "Membership epoch this process works in", **kw)
        self.serving_version = prom.Gauge("refit_serving_version", "Committed version an inference rank serves",
                                          **kw)
        self.detached = prom.Gauge("refit_detached", "1 while this member is out of the job: its lease was lost "
                                   "and it registers again as a new incarnation, or it stopped (membership lost "
                                   "for good)", **kw)
        self.rejoins = prom.Counter("refit_rejoins", "Times this process came back as a new incarnation", **kw)

    def __call__(self, event: str, fields: dict[str, Any]) -> None:
        role = str(fields.get("role", ""))
        if event == "refit.transfer.done":
            self.transfer_seconds.labels(role).observe(float(fields["seconds"]))
            for name, direction, path in (("network_send_bytes", "send", "network"),
                                          ("network_recv_bytes", "recv", "network"),
                                          ("intra_recv_bytes", "recv", "intra"), ("local_bytes", "recv", "local")):
                if fields.get(name):
                    self.bytes.labels(direction, path).inc(int(fields[name]))
            self.attempts.labels(role, "transferred").inc()
        elif event == "refit.plan.built":
            self.plan_seconds.labels(role).observe(float(fields["seconds"]))
        elif event == "refit.attempt.failed":
            self.attempts.labels(role, "failed").inc()
        elif event == "refit.version.committed":
            self.versions.labels(role).inc()
        elif event == "fault.detected":
            self.faults.labels(str(fields.get("kind", "unknown"))).inc()
            if fields.get("kind") == "membership_lost":  # out for good: no rejoin clears it
                self.detached.set(1)
        elif event == "refit.epoch.entered":
            self.epoch.set(int(fields["epoch"]))
        elif event == "refit.version.serving":
            self.serving_version.set(int(fields["version"]))
        elif event == "refit.member.detached":
            self.detached.set(1)
        elif event == "refit.member.rejoined":
            self.detached.set(0)
            self.rejoins.inc()

    def serve(self, address: str = "127.0.0.1:9464") -> tuple[str, int]:
        """Serve the metrics over HTTP on ``address`` (``host:port``; port 0 picks a free one),
        in a daemon thread; returns the bound ``(host, port)``. The default binds to loopback
        only: expose the endpoint (``0.0.0.0:9464``, or the pod's address) deliberately."""
        import prometheus_client as prom

        host, sep, port_text = address.rpartition(":")
        if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) < 65536:
            raise ValueError(f"metrics address must look like host:port, got {address!r}")
        try:
            server, _ = prom.start_http_server(int(port_text), addr=host.strip("[]"), registry=self.registry)
        except OSError as exc:
            raise ValueError(f"metrics address {address!r} cannot be bound: {exc.strerror or exc}") from None
        bound_host, bound_port = server.server_address[:2]
        return str(bound_host), int(bound_port)
