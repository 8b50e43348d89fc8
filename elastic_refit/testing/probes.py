"""What benchmarks read of a process (resident memory, CPU seconds) and of etcd (its count
of gRPC requests), from /proc and etcd's metrics endpoint."""

from __future__ import annotations

import contextlib
import os

__all__ = ["cpu_seconds", "etcd_requests", "rss_bytes"]

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int | None:
    """Resident memory of process ``pid`` (None once it is gone)."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return None


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of process ``pid`` so far."""
    with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()  # past "pid (comm)": utime, stime are 14, 15
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return None


def etcd_requests(endpoint: str) -> dict[str, float]:
    """etcd's count of gRPC messages received so far, by method (unary requests and stream
    messages such as lease keepalives and watch progress requests), from its metrics."""
    import urllib.request

    url = endpoint if "://" in endpoint else f"http://{endpoint}"  # the benchmarks' etcd is plain http
    with urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=5) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("grpc_server_msg_received_total{"):
            labels, value = line.rsplit(" ", 1)
            method = labels.split('grpc_method="', 1)[1].split('"', 1)[0]
            out[method] = out.get(method, 0.0) + float(value)
    return out
