"""Cost model: predicted refit seconds of a plan on a described cluster, beside the bound.

The model is deliberately simple and explicit: every GPU has one NIC share (GB/s each way)
and one NVLink share; network transfers of the deliver phase run concurrently, then the
intra-domain fan-out; each message round costs one latency.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from elastic_refit.plan.types import Plan

__all__ = ["CLUSTERS", "GB", "Cluster", "Prediction", "get_cluster", "predict"]

GB = 1e9


@dataclass(frozen=True, slots=True)
class Cluster:
    """Per-GPU bandwidths (GB/s, each direction), NVLink domain size, per-message latency."""

    name: str
    nic_gbps: float
    nvlink_gbps: float
    domain_size: int
    latency_s: float = 20e-6

    def __post_init__(self) -> None:
        if self.nic_gbps <= 0 or self.nvlink_gbps <= 0:
            raise ValueError(f"cluster {self.name!r}: bandwidths must be > 0, got nic={self.nic_gbps} "
                             f"nvlink={self.nvlink_gbps}")
        if self.domain_size < 1:
            raise ValueError(f"cluster {self.name!r}: domain size must be >= 1, got {self.domain_size}")
        if self.latency_s < 0:
            raise ValueError(f"cluster {self.name!r}: latency must be >= 0, got {self.latency_s}")


CLUSTERS: dict[str, Cluster] = {
    "h100-dgx": Cluster("h100-dgx", nic_gbps=50.0, nvlink_gbps=450.0, domain_size=8),
    "gb200-nvl72": Cluster("gb200-nvl72", nic_gbps=50.0, nvlink_gbps=900.0, domain_size=72),
}


def get_cluster(name: str) -> Cluster:
    try:
        return CLUSTERS[name]
    except KeyError:
        raise ValueError(f"unknown cluster {name!r}; known: {', '.join(CLUSTERS)}") from None


@dataclass(frozen=True, slots=True)
class Prediction:
    """Predicted seconds of one plan, and the physical bound for the same layouts."""

    cluster: str
    seconds: float
    network_seconds: float
    intra_seconds: float
    latency_seconds: float
    bound_seconds: float


def predict(plan: Plan, cluster: Cluster) -> Prediction:
    """Predict the refit time of ``plan`` on ``cluster``.

    Bound: the cross-domain lower bound must enter each destination domain through that
    domain's NICs, and leave through the source ranks' NICs; no plan beats either.
    """
    nic = cluster.nic_gbps * GB
    nvlink = cluster.nvlink_gbps * GB
    network = float(np.maximum(plan.network_send_bytes, plan.network_recv_bytes).max(initial=0)) / nic
    intra = float(np.maximum(plan.intra_send_bytes, plan.intra_recv_bytes).max(initial=0)) / nvlink
    latency = plan.stats.num_rounds * cluster.latency_s

    domains = np.unique(plan.topology.domain_array(), return_inverse=True)[1]
    ranks_per_domain = np.bincount(domains)
    need_per_domain = np.bincount(domains, weights=plan.network_recv_bytes.astype(np.float64),
                                  minlength=ranks_per_domain.size)
    ingress = float((need_per_domain / ranks_per_domain).max(initial=0)) / nic
    egress = plan.stats.lower_bound_bytes / max(plan.stats.num_source_ranks, 1) / nic
    return Prediction(
        cluster=cluster.name,
        seconds=network + intra + latency,
        network_seconds=network,
        intra_seconds=intra,
        latency_seconds=latency,
        bound_seconds=max(ingress, egress),
    )
