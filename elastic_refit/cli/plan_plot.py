"""`elastic-refit plan ... --plot FILE.png|svg`: a plan as two pictures.

Left: a domain x domain matrix of the bytes the plan moves (rows: the sending domain,
columns: the receiving one; the diagonal is NVLink fan-out and local copies). Right: the bytes
each rank's NIC sends and receives, busiest first, beside the bound (the cross-domain lower
bound spread evenly over the NICs of the destination ranks: no plan can keep the busiest
receiving NIC under it). matplotlib is an optional extra (``pip install 'elastic-refit[plot]'``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from elastic_refit.plan import Plan

__all__ = ["PLOT_FORMATS", "check_plot_path", "domain_matrix", "nic_bytes", "save_plot"]

PLOT_FORMATS = (".png", ".svg")
_EXTRA_HINT = "pip install 'elastic-refit[plot]' (matplotlib)"


def check_plot_path(path: str) -> Path:
    """The plot's path; ``ValueError`` for another suffix or a missing matplotlib (before
    any planning, so a long plan is not wasted)."""
    out = Path(path)
    if out.suffix.lower() not in PLOT_FORMATS:
        raise ValueError(f"--plot takes a .png or .svg file, got {path!r}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(f"--plot needs matplotlib, which is not installed: {_EXTRA_HINT}") from None
    return out


def domain_matrix(plan: Plan) -> np.ndarray:
    """``[D, D]`` bytes the plan moves from domain ``i`` (rows) to domain ``j`` (columns)."""
    domains = np.asarray(plan.topology.domains, dtype=np.int64)
    t = plan.transfers
    num = int(domains.max()) + 1
    out = np.zeros((num, num), dtype=np.float64)
    np.add.at(out, (domains[t.src_rank], domains[t.dst_rank]), (t.nbytes * t.instances).astype(np.float64))
    return out


def nic_bytes(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """Per rank: network bytes sent, network bytes received (the plan's own per-NIC figures)."""
    return np.asarray(plan.network_send_bytes, dtype=np.float64), np.asarray(plan.network_recv_bytes, np.float64)


def _span(plan: Plan, ranks) -> str:
    domains = sorted({plan.topology.domains[r] for r in ranks})
    return f"{domains[0]}-{domains[-1]}" if domains else "-"


def save_plot(plan: Plan, path: Path, title: str) -> None:
    """Draw the matrix and the per-NIC bars into ``path`` (its suffix picks PNG or SVG)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    gib = float(1 << 30)
    matrix = domain_matrix(plan) / gib
    send, recv = nic_bytes(plan)
    num_dst = max(plan.stats.num_destination_ranks, 1)
    bound = plan.stats.lower_bound_bytes / num_dst / gib
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 6.5), gridspec_kw={"width_ratios": [1, 1.25]})
    shown = np.where(matrix > 0, matrix, np.nan)
    positive = matrix[matrix > 0]
    norm = LogNorm(vmin=positive.min(), vmax=positive.max()) if positive.size and positive.min() < positive.max() \
        else None
    image = left.imshow(shown, cmap="viridis", norm=norm, interpolation="nearest")
    left.set_title(f"bytes planned, domain to domain ({matrix.shape[0]} domains)")
    left.set_xlabel(f"receiving domain (destination ranks in domains {_span(plan, plan.destination.ranks)})")
    left.set_ylabel(f"sending domain (source ranks in domains {_span(plan, plan.source.ranks)})")
    fig.colorbar(image, ax=left, fraction=0.046, pad=0.04, label="GiB (log scale; blank: nothing)")
    order_recv, order_send = np.sort(recv[recv > 0])[::-1], np.sort(send[send > 0])[::-1]
    right.plot(np.arange(order_recv.size), order_recv / gib, drawstyle="steps-post", color="tab:blue",
               label=f"received, {order_recv.size} NICs")
    right.fill_between(np.arange(order_recv.size), order_recv / gib, step="post", alpha=0.25, color="tab:blue")
    right.plot(np.arange(order_send.size), order_send / gib, drawstyle="steps-post", color="tab:orange",
               label=f"sent, {order_send.size} NICs")
    right.axhline(bound, color="black", linestyle="--",
                  label=f"bound: lower bound / {num_dst} destination NICs = {bound:.2f} GiB")
    right.set_title("network bytes per NIC, busiest first")
    right.set_xlabel("NICs (ranks), sorted by bytes")
    right.set_ylabel("GiB")
    right.set_ylim(0, 1.2 * max(float(send.max(initial=0)), float(recv.max(initial=0)), bound * gib) / gib)
    right.legend(loc="lower left", framealpha=0.95)
    s = plan.stats
    fig.suptitle(f"{title}\ncross-domain {s.cross_domain_bytes / gib:,.1f} GiB = "
                 f"{s.cross_domain_bytes / max(s.lower_bound_bytes, 1):.3f} x lower bound; busiest NIC sends "
                 f"{s.max_send_bytes / gib:.2f} GiB, receives {s.max_recv_bytes / gib:.2f} GiB")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
