"""Cost model: predicted refit seconds of a plan on a described cluster, beside the bound.

The model is deliberately simple and explicit. Every GPU has one NIC share and one NVLink
share (GB/s each way, both directions at once); each message round costs one latency.

- Relayed plans (``Plan.relayed``: ``PlanOptions.relay`` "on", or "auto" where ingress
  balance lowers the busiest NIC) forward every cross-domain region over NVLink bucket
  by bucket while the next bucket crosses the network, so a rank's NIC and NVLink phases
  overlap: per rank, time = max(NIC bytes / NIC rate, NVLink bytes / NVLink rate) plus one
  chunk of pipeline fill (the first chunk must arrive before forwarding starts, or the last
  one is forwarded after the network is done), and the refit takes the slowest rank's time
  plus the rounds' latency.
- Plans without relay fan out after the network phase: the busiest NIC, then the busiest
  NVLink, plus the rounds' latency.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from elastic_refit.plan.types import Plan, SourceSide

__all__ = ["CLUSTERS", "GB", "Cluster", "DeltaPrediction", "Prediction", "bound_seconds", "delta_fraction",
           "get_cluster", "predict", "predict_delta"]

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
    """The described cluster called ``name``; ``ValueError`` names the known ones."""
    try:
        return CLUSTERS[name]
    except KeyError:
        raise ValueError(f"unknown cluster {name!r}; known: {', '.join(CLUSTERS)}") from None


@dataclass(frozen=True, slots=True)
class Prediction:
    """Predicted seconds of one plan, and the physical bound for the same layouts.

    ``network_seconds`` and ``intra_seconds`` are the busiest NIC's and the busiest NVLink's
    time; ``fill_seconds`` the pipeline fill (0 without relay)."""

    cluster: str
    seconds: float
    network_seconds: float
    intra_seconds: float
    latency_seconds: float
    bound_seconds: float
    fill_seconds: float = 0.0


def bound_seconds(plan: Plan, cluster: Cluster) -> float:
    """No plan with these layouts is faster (cross-domain bytes at their lower bound).

    Ingress: what a destination domain needs from outside enters through that domain's
    NICs, at best evenly. Egress: a region leaves only through a NIC of a domain that holds
    it, so the bytes held only inside a set of source domains leave through those domains'
    NICs (``Plan.egress_group_*``: the busiest such set).
    """
    nic = cluster.nic_gbps * GB
    domains = np.unique(plan.topology.domain_array(), return_inverse=True)[1]
    ranks_per_domain = np.bincount(domains)
    need_per_domain = np.bincount(domains, weights=plan.network_recv_bytes.astype(np.float64),
                                  minlength=ranks_per_domain.size)
    ingress = float((need_per_domain / ranks_per_domain).max(initial=0)) / nic
    egress = plan.egress_group_bytes / max(plan.egress_group_ranks, 1) / nic
    return max(ingress, egress)


def predict(plan: Plan, cluster: Cluster) -> Prediction:
    """Predict the refit time of ``plan`` on ``cluster`` (see the module docstring)."""
    nic = cluster.nic_gbps * GB
    nvlink = cluster.nvlink_gbps * GB
    nic_seconds = np.maximum(plan.network_send_bytes, plan.network_recv_bytes) / nic
    nvlink_seconds = np.maximum(plan.intra_send_bytes, plan.intra_recv_bytes) / nvlink
    latency = plan.stats.num_rounds * cluster.latency_s
    t = plan.transfers
    forward = t.src_side == int(SourceSide.RELAY)
    fill = 0.0
    if forward.any():
        # The ranks that forward or receive forwards pay one chunk (a bucket of the network
        # stream, or less when they move less) on the slower of their two phases' links.
        weight = (t.nbytes * t.instances)[forward].astype(np.float64)
        num_ranks = plan.topology.num_ranks
        forwarded = (np.bincount(t.src_rank[forward], weights=weight, minlength=num_ranks)
                     + np.bincount(t.dst_rank[forward], weights=weight, minlength=num_ranks))
        chunk = np.minimum(forwarded, plan.options.max_transfer_bytes)
        fill_per_rank = np.where(nic_seconds >= nvlink_seconds, chunk / nvlink, chunk / nic)
        per_rank = np.maximum(nic_seconds, nvlink_seconds) + fill_per_rank
        busiest = int(np.argmax(per_rank))
        seconds = float(per_rank[busiest]) + latency
        fill = float(fill_per_rank[busiest])
    else:
        seconds = float(nic_seconds.max(initial=0)) + float(nvlink_seconds.max(initial=0)) + latency
    return Prediction(
        cluster=cluster.name,
        seconds=seconds,
        network_seconds=float(nic_seconds.max(initial=0)),
        intra_seconds=float(nvlink_seconds.max(initial=0)),
        latency_seconds=latency,
        bound_seconds=bound_seconds(plan, cluster),
        fill_seconds=fill,
    )


# Deltas (DESIGN.md, "Deltas"): a region whose elements changed with density ``d`` travels as
# byte gaps plus values (``kernels.delta``): per changed element one byte of position and its
# value, plus a skip byte per 255 unchanged elements. Encode and apply run at the rates
# measured with plain torch on an H200 (issue 35): they read every byte of a sender's and a
# receiver's buffers once.
ENCODE_GBPS = 539.0
APPLY_GBPS = 6700.0


def delta_fraction(density: float, itemsize: int = 2) -> float:
    """Bytes of a delta over the bytes of the region, for elements of ``itemsize`` bytes of
    which a fraction ``density`` changed (never above 1: a larger delta goes in full)."""
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {density}")
    return min(1.0, density * (1 + itemsize) / itemsize + 1.0 / (255 * itemsize))


@dataclass(frozen=True, slots=True)
class DeltaPrediction:
    """Predicted seconds of ``plan`` sent as deltas at ``density`` beside its full refit:
    the network bytes scale by ``fraction``, and so do the intra-domain bytes (a relay
    forwards the deltas' segments as they arrived; a destination that fans out what it
    received sends its change), and senders encode and receivers apply at ``ENCODE_GBPS`` /
    ``APPLY_GBPS``."""

    density: float
    fraction: float
    seconds: float
    network_seconds: float
    codec_seconds: float
    wire_bytes: int  # cross-domain bytes at this density
    bound_bytes: int  # the full-weights lower bound (cross-domain)
    full: Prediction


def predict_delta(plan: Plan, cluster: Cluster, density: float, itemsize: int = 2) -> DeltaPrediction:
    """Predict ``plan``'s refit on ``cluster`` when a fraction ``density`` of the elements
    changed since the base every destination holds (see :class:`DeltaPrediction`)."""
    full = predict(plan, cluster)
    fraction = delta_fraction(density, itemsize)
    nic = cluster.nic_gbps * GB
    nvlink = cluster.nvlink_gbps * GB
    nic_seconds = float((np.maximum(plan.network_send_bytes, plan.network_recv_bytes) * fraction).max(initial=0)) / nic
    nvlink_seconds = float(np.maximum(plan.intra_send_bytes, plan.intra_recv_bytes).max(initial=0)) * fraction / nvlink
    codec = (float(plan.network_send_bytes.max(initial=0)) / (ENCODE_GBPS * GB)
             + float(plan.network_recv_bytes.max(initial=0)) / (APPLY_GBPS * GB))
    seconds = nic_seconds + nvlink_seconds + full.latency_seconds + codec
    return DeltaPrediction(density, fraction, seconds, nic_seconds, codec,
                           int(plan.stats.cross_domain_bytes * fraction), int(plan.stats.lower_bound_bytes), full)
