"""`elastic-refit plan`: build a plan and print its figures."""

from __future__ import annotations

import argparse
import dataclasses
import resource
import time
from pathlib import Path
from typing import Any

import numpy as np

from elastic_refit.cli._output import (
    format_bytes,
    format_seconds,
    print_json,
    progress,
    render_table,
)
from elastic_refit.layout import RefitSpec, TensorFormats, load_spec, parse_format
from elastic_refit.layout.formats import FORMAT_NAMES
from elastic_refit.plan import (
    RELAY_MODES,
    Plan,
    PlanOptions,
    RankPlan,
    TransferKind,
    make_plan,
    make_rank_plan,
)
from elastic_refit.plan.cost import (
    CLUSTERS,
    DeltaPrediction,
    Prediction,
    get_cluster,
    predict,
    predict_delta,
)
from elastic_refit.plan.quantized import format_layouts

__all__ = ["add_case_arguments", "add_format_argument", "check_format_flag", "destination_formats", "load_case", "plan_figures",
           "quantized_figures", "rank_figures", "register", "run"]

# Peers listed in the readable --rank table (--json lists them all).
_SHOWN_PEERS = 20


def add_case_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments that describe a refit: a spec file, or a model with two parallelisms."""
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--spec", help="layout spec file (JSON)")
    what.add_argument("--model", help=model_help())
    parser.add_argument("--source", help="training parallelism, e.g. tp=4,pp=8,ep=16,dp=4")
    parser.add_argument("--destination", help="inference parallelism, e.g. tp=8,dp=16")
    parser.add_argument("--layers", type=int, default=None, help="cut the model to its first N layers")
    parser.add_argument("--domain-size", type=int, default=None,
                        help="ranks per NVLink domain (default: the cluster's, else 8)")
    parser.add_argument("--colocate", action="store_true",
                        help="destination ranks start at 0 and share devices with the source")
    parser.add_argument("--bucket-mib", type=int, default=64, help="bucket size in MiB (default 64)")
    add_format_argument(parser)
    parser.add_argument("--relay", nargs="?", choices=RELAY_MODES, default="auto", const="on",
                        help="ingress balance over every NIC of a destination domain, regions forwarded over "
                             "NVLink under the network transfer (PlanOptions.relay): auto (default) where it "
                             "lowers the busiest NIC, on (also a bare --relay) always, off never")


def model_help() -> str:
    """``--model``'s help: every preset by name (``--help`` lists the choices)."""
    from elastic_refit.layout.models import MODELS

    return f"model preset: {', '.join(MODELS)}; or a local Hugging Face config.json"


def add_format_argument(parser: argparse.ArgumentParser) -> None:
    """``--destination-format``: how the destination stores the tensors a format applies to."""
    parser.add_argument("--destination-format", default=None, metavar="FORMAT",
                        help=f"destination format ({', '.join(FORMAT_NAMES)}; default: what the spec or preset "
                             f"declares, bf16 for presets): the tensors the spec quantizes (a spec that quantizes "
                             f"none: every matrix; a model: what its FP8 checkpoints quantize) in FORMAT, bf16: "
                             f"none")


def destination_formats(spec: RefitSpec, value: str | None, model: str | None, num_layers: int | None) -> TensorFormats:
    """The destination formats of a case: the spec's unless ``value`` (a format name) says
    otherwise (module docstring of ``add_format_argument``); ``ValueError`` for an unknown name."""
    if value is None:
        return spec.destination_formats
    fmt = parse_format(value)
    if not fmt.quantized:
        return TensorFormats()
    if model is not None:
        from elastic_refit.layout import checkpoint_formats

        return checkpoint_formats(model, fmt, num_layers=num_layers)
    names = list(spec.destination_formats) or [
        t.name for t in spec.destination.tensors if len(t.shape) >= 2 and t.dtype in ("bfloat16", "float16", "float32")]
    return TensorFormats.uniform(names, fmt)


def check_format_flag(args: argparse.Namespace) -> str | None:
    """``args.destination_format`` (None when not given); ``ValueError`` naming the flag and
    the known formats for a name ``parse_format`` does not know."""
    value = getattr(args, "destination_format", None)
    if value is not None:
        try:
            parse_format(value)
        except ValueError:
            raise ValueError(f"--destination-format must be one of {', '.join(FORMAT_NAMES)}, got {value!r}") from None
    return value


def load_case(args: argparse.Namespace, cluster_domain_size: int | None = None) -> tuple[RefitSpec, str]:
    """The RefitSpec the arguments describe (its ``destination_formats`` as
    ``--destination-format`` says), and a one-line description of it."""
    for flag, value in (("--domain-size", args.domain_size), ("--layers", args.layers)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    value = check_format_flag(args)
    if args.spec:
        spec = load_spec(args.spec)
        if value is not None:
            spec = dataclasses.replace(spec, destination_formats=destination_formats(spec, value, None, None))
        return spec, f"spec {args.spec}"
    if not args.source or not args.destination:
        raise ValueError("--model needs --source and --destination (e.g. --source tp=2,pp=2 --destination tp=2,dp=2)")
    from elastic_refit.layout.refit import model_refit_spec

    domain_size = args.domain_size or cluster_domain_size or 8
    spec = model_refit_spec(args.model, args.source, args.destination, domain_size=domain_size,
                            num_layers=args.layers, colocate=args.colocate,
                            destination_format=value if value is not None else "bf16")
    layers = f", {args.layers} layers" if args.layers else ""
    return spec, f"{args.model}{layers}: {args.source} -> {args.destination}"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("plan", help="build a refit plan and print its figures")
    add_case_arguments(parser)
    parser.add_argument("--cluster", choices=sorted(CLUSTERS),
                        help=f"predict seconds on this cluster: {', '.join(sorted(CLUSTERS))}")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--delta-density", metavar="D[,D...]", default=None,
                        help="with --cluster: also predict the refit sent as deltas when this fraction of "
                             "the elements changed since the last commit (e.g. 0.02,0.05,0.13)")
    parser.add_argument("--plot", metavar="FILE", default=None,
                        help="also draw the plan into FILE (.png or .svg): a domain x domain matrix of planned "
                             "bytes and the bytes of every NIC against the bound (needs the [plot] extra)")
    parser.add_argument("--rank", type=int, default=None,
                        help="plan only this rank's view (what it sends, receives and copies), as every rank "
                             "does at run time; plans that relay are refused. With --model (bf16) the rank "
                             "plans from the layouts' rules, never building either side's explicit pieces")
    parser.add_argument("--explicit-layouts", action="store_true",
                        help="with --rank and --model: build both sides' explicit layouts first (as before "
                             "symbolic layouts; for comparison)")
    parser.set_defaults(handler=run)


def plan_figures(plan: Plan, plan_seconds: float) -> dict[str, Any]:
    """The ``--json`` object: every figure of ``plan.stats`` under its own name (``*_bytes``,
    ``num_*``), the plan time and the fingerprint."""
    return {**dataclasses.asdict(plan.stats), "plan_seconds": plan_seconds, "fingerprint": plan.fingerprint}


def quantized_figures(plan: Plan, bf16: Plan, cluster=None) -> dict[str, Any]:
    """Figures a plan in a quantized destination format adds to ``--json``: the format, the
    partial-amax exchange's bytes (already inside the plan's figures) and what the BF16 plan
    of the same refit would be (``bf16_*``: bytes, cross-domain bytes, lower bound, and with
    a cluster its predicted and bound seconds)."""
    q = plan.quantization
    amax = q.amax if q is not None else None
    names = sorted({f.name for _, f in q.formats.entries}) if q is not None else []
    b = bf16.stats
    out: dict[str, Any] = {
        "destination_format": ",".join(names) or "bf16",
        "num_quantized_tensors": len(q.formats) if q is not None else 0,
        "amax_exchange_bytes": int(amax.nbytes.sum()) if amax is not None else 0,
        "amax_exchange_cross_domain_bytes": amax.bytes_of(int(TransferKind.NETWORK)) if amax is not None else 0,
        "bf16_dst_bytes": b.dst_bytes,
        "bf16_cross_domain_bytes": b.cross_domain_bytes,
        "bf16_intra_domain_bytes": b.intra_domain_bytes,
        "bf16_lower_bound_bytes": b.lower_bound_bytes,
        "bf16_max_recv_bytes": b.max_recv_bytes,
    }
    if cluster is not None:
        p = predict(bf16, cluster)
        out.update(bf16_predicted_seconds=p.seconds, bf16_bound_seconds=p.bound_seconds)
    return out


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def rank_figures(view: RankPlan, plan_seconds: float, cluster=None) -> dict[str, Any]:
    """The ``--rank --json`` object: the rank, its bytes per direction and kind, its rows and
    messages, its peers (one entry per peer, direction and kind), the plan time, the process's
    peak RSS, the input fingerprint; with a cluster, the seconds its own bytes take there
    (its NIC, then its NVLink, plus one latency per round of the plan, as ``cost.predict``
    counts them for plans without relay)."""
    t = view.transfers
    by_kind = view.bytes_by_kind()
    weight = t.nbytes * t.instances
    peers = []
    for direction, mine, other in (("send", t.src_rank, t.dst_rank), ("recv", t.dst_rank, t.src_rank)):
        rows = np.flatnonzero((mine == view.rank) & (t.kind != int(TransferKind.LOCAL)))
        # per (peer, kind): bytes, and messages counted as distinct message ids
        pairs, pair_of = np.unique(np.stack([other[rows], t.kind[rows]], axis=1), axis=0, return_inverse=True)
        pair_of = pair_of.reshape(-1)
        pair_bytes = np.bincount(pair_of, weights=weight[rows], minlength=len(pairs))
        distinct = np.unique(np.stack([pair_of, t.message[rows]], axis=1), axis=0)
        pair_messages = np.bincount(distinct[:, 0], minlength=len(pairs)) if distinct.size else np.zeros(len(pairs))
        peers += [{"direction": direction, "peer": int(peer), "kind": TransferKind(int(kind)).name.lower(),
                   "bytes": int(nbytes), "num_messages": int(count)}
                  for (peer, kind), nbytes, count in zip(pairs.tolist(), pair_bytes.tolist(), pair_messages.tolist(),
                                                         strict=True)]
    figures: dict[str, Any] = {
        "rank": view.rank,
        "plan_seconds": plan_seconds,
        "peak_rss_bytes": _peak_rss_bytes(),
        "send_bytes": by_kind["network_send"] + by_kind["intra_send"],
        "recv_bytes": by_kind["network_recv"] + by_kind["intra_recv"],
        **{f"{name}_bytes": value for name, value in by_kind.items()},
        "num_rows": len(t),
        "num_messages": int(np.unique(t.message[t.kind != int(TransferKind.LOCAL)]).size),
        "num_rounds": view.num_rounds,
        "fingerprint": view.fingerprint,
        "peers": peers,
    }
    if cluster is not None:
        nic = max(by_kind["network_send"], by_kind["network_recv"]) / (cluster.nic_gbps * 1e9)
        nvlink = max(by_kind["intra_send"], by_kind["intra_recv"]) / (cluster.nvlink_gbps * 1e9)
        figures.update(cluster=cluster.name, predicted_seconds=nic + nvlink + view.num_rounds * cluster.latency_s)
    return figures


def _run_rank(args: argparse.Namespace, spec, description: str, options: PlanOptions, cluster,
              layout_seconds: float) -> int:
    if not args.json:
        progress(f"planning rank {args.rank}'s view ({spec.source.num_pieces} source pieces, "
                 f"{spec.destination.num_pieces} destination pieces) ...")
    t0 = time.perf_counter()
    source, destination = spec.source, spec.destination
    if spec.destination_formats:  # the rank's rows in the destination format (FP8 bytes and scales)
        source, destination, _ = format_layouts(source, destination, spec.destination_formats)
    view = make_rank_plan(source, destination, spec.topology, options, rank=args.rank)
    figures = rank_figures(view, time.perf_counter() - t0, cluster)
    figures["layout_seconds"] = layout_seconds  # building both sides' layouts, before the rank's plan
    figures["layouts"] = "explicit"
    return _print_rank(args, figures, description, spec.topology.num_ranks)


def _run_rank_from_rules(args: argparse.Namespace, options: PlanOptions, cluster) -> int:
    """``--rank`` with ``--model``: the rank's view from both sides' rules (issue 40)."""
    from elastic_refit.layout.refit import model_refit_rules
    from elastic_refit.plan.rank_rules import make_rank_plan_from_rules

    if not args.source or not args.destination:
        raise ValueError("--model needs --source and --destination (e.g. --source tp=2,pp=2 --destination tp=2,dp=2)")
    t0 = time.perf_counter()
    domain_size = args.domain_size or (cluster.domain_size if cluster else None) or 8
    source, destination, topology = model_refit_rules(args.model, args.source, args.destination,
                                                      domain_size=domain_size, num_layers=args.layers,
                                                      colocate=args.colocate)
    layout_seconds = time.perf_counter() - t0
    if not args.json:
        progress(f"planning rank {args.rank}'s view from rules ({len(source.rules)} source rules, "
                 f"{len(destination.rules)} destination rules) ...")
    t0 = time.perf_counter()
    view = make_rank_plan_from_rules(source, destination, topology, options, rank=args.rank)
    figures = rank_figures(view, time.perf_counter() - t0, cluster)
    figures["layout_seconds"] = layout_seconds  # the rules of both sides; the rank's pieces are in plan_seconds
    figures["layouts"] = "rules"
    layers = f", {args.layers} layers" if args.layers else ""
    return _print_rank(args, figures, f"{args.model}{layers}: {args.source} -> {args.destination}",
                       topology.num_ranks)


def _print_rank(args: argparse.Namespace, figures: dict[str, Any], description: str, num_ranks: int) -> int:
    if args.json:
        print_json(figures)
        return 0
    rows = [
        ("network send / recv", f"{format_bytes(figures['network_send_bytes'])} / "
                                f"{format_bytes(figures['network_recv_bytes'])}"),
        ("intra-domain send / recv", f"{format_bytes(figures['intra_send_bytes'])} / "
                                     f"{format_bytes(figures['intra_recv_bytes'])}"),
        ("local copies", format_bytes(figures["local_bytes"])),
        ("rows / messages / plan rounds", f"{figures['num_rows']}/{figures['num_messages']}/{figures['num_rounds']}"),
        ("plan time (this rank)", format_seconds(figures["plan_seconds"])),
        ("peak RSS (process)", format_bytes(figures["peak_rss_bytes"])),
    ]
    if "cluster" in figures:
        rows.append((f"its bytes on {figures['cluster']}", format_seconds(figures["predicted_seconds"])))
    print(f"{description}  |  rank {args.rank} of {num_ranks} (layouts from {figures['layouts']})")
    print(render_table(("figure", "value"), rows))
    peers = sorted(figures["peers"], key=lambda p: (-p["bytes"], p["direction"], p["peer"]))
    if peers:
        print(render_table(("direction", "peer", "kind", "messages", "bytes"),
                           [(p["direction"], p["peer"], p["kind"], p["num_messages"], format_bytes(p["bytes"]))
                            for p in peers[:_SHOWN_PEERS]]))
        if len(peers) > _SHOWN_PEERS:
            print(f"... and {len(peers) - _SHOWN_PEERS} more peers (--json lists them all)")
    print(f"input fingerprint {figures['fingerprint']}")
    return 0


def run(args: argparse.Namespace) -> int:
    """``elastic-refit plan``: the whole plan's figures, or with ``--rank`` one rank's view."""
    cluster = get_cluster(args.cluster) if args.cluster else None
    plot_path = _check_run_flags(args)
    if _plans_rank_from_rules(args):
        return _run_rank_from_rules(args, _plan_options(args), cluster)
    if not args.json:
        progress("building layouts ...")
    t0 = time.perf_counter()
    spec, description = load_case(args, cluster.domain_size if cluster else None)
    layout_seconds = time.perf_counter() - t0
    options = _plan_options(args)
    if args.rank is not None:
        return _run_rank(args, spec, description, options, cluster, layout_seconds)
    return _run_plan(args, spec, description, options, cluster, layout_seconds, plot_path)


def _check_run_flags(args: argparse.Namespace) -> Path | None:
    """Refuse, before any work, what ``run`` cannot do: ``--bucket-mib`` below 1, an unknown
    ``--destination-format``, ``--plot`` with ``--rank`` or to a file it cannot draw; the
    plot's path (None without ``--plot``)."""
    if args.bucket_mib < 1:
        raise ValueError(f"--bucket-mib must be >= 1, got {args.bucket_mib}")
    check_format_flag(args)
    if getattr(args, "plot", None) is None:
        return None
    from elastic_refit.cli.plan_plot import check_plot_path

    if args.rank is not None:
        raise ValueError("--plot draws the whole plan; leave out --rank")
    return check_plot_path(args.plot)


def _plans_rank_from_rules(args: argparse.Namespace) -> bool:
    """Whether ``--rank`` plans from the layouts' rules: a model in bf16 without
    ``--explicit-layouts``."""
    return (args.rank is not None and bool(args.model) and not getattr(args, "explicit_layouts", False)
            and check_format_flag(args) in (None, "bf16"))


def _plan_options(args: argparse.Namespace) -> PlanOptions:
    """The planner's options the arguments ask for (bucket size, relay)."""
    return PlanOptions(bucket_bytes=args.bucket_mib << 20, relay=args.relay)


def _run_plan(args: argparse.Namespace, spec: RefitSpec, description: str, options: PlanOptions, cluster,
              layout_seconds: float, plot_path: Path | None) -> int:
    """The whole plan: plan it, gather its figures (predictions on a cluster, the BF16
    comparison of a quantized format), draw it when asked, and print it."""
    if not args.json:
        progress(f"planning ({spec.source.num_pieces} source pieces, {spec.destination.num_pieces} destination pieces) ...")
    t0 = time.perf_counter()
    formats = spec.destination_formats
    plan = make_plan(spec.source, spec.destination, spec.topology, options, formats=formats)
    figures = plan_figures(plan, time.perf_counter() - t0)
    figures["layout_seconds"] = layout_seconds
    prediction = _add_prediction(figures, plan, cluster)
    deltas = _add_deltas(figures, plan, cluster, args.delta_density)
    bf16 = None
    if formats:
        bf16 = _add_bf16_comparison(figures, plan, spec, options, cluster, quiet=args.json)
    if plot_path is not None:
        from elastic_refit.cli.plan_plot import save_plot

        save_plot(plan, plot_path, description)
        if not args.json:
            progress(f"plot written to {plot_path}")
    if args.json:
        print_json(figures)
        return 0
    rows = (_plan_rows(plan, figures) + _cluster_rows(plan, prediction, deltas)
            + (_quantized_rows(plan, bf16, formats, figures) if bf16 is not None else []))
    s = plan.stats
    print(f"{description}  |  {s.num_source_ranks} source ranks, {s.num_destination_ranks} "
          f"destination ranks, {s.num_domains} domains")
    print(render_table(("figure", "value", "ratio / note"), rows))
    print(f"fingerprint {plan.fingerprint}")
    return 0


def _add_prediction(figures: dict[str, Any], plan: Plan, cluster) -> Prediction | None:
    """With a cluster: the plan's predicted seconds there, also added to ``figures``."""
    prediction = predict(plan, cluster) if cluster else None
    if prediction:
        figures.update(cluster=prediction.cluster, predicted_seconds=prediction.seconds,
                       bound_seconds=prediction.bound_seconds)
    return prediction


def _add_deltas(figures: dict[str, Any], plan: Plan, cluster, value: str | None) -> list[DeltaPrediction]:
    """``--delta-density``'s predictions of the plan sent as deltas, also added to ``figures``
    (as ``deltas``)."""
    deltas = [predict_delta(plan, cluster, d) for d in _densities(value, cluster)]
    if deltas:
        figures["deltas"] = [{"density": d.density, "wire_fraction": d.fraction, "predicted_seconds": d.seconds,
                              "network_seconds": d.network_seconds, "codec_seconds": d.codec_seconds,
                              "wire_bytes": d.wire_bytes, "bound_bytes": d.bound_bytes} for d in deltas]
    return deltas


def _add_bf16_comparison(figures: dict[str, Any], plan: Plan, spec: RefitSpec, options: PlanOptions, cluster,
                         quiet: bool) -> Plan:
    """The same refit planned in BF16, for the comparison a quantized plan is about; its
    figures (``quantized_figures``) added to ``figures``."""
    if not quiet:
        progress("planning the same refit in bf16, for comparison ...")
    bf16 = make_plan(spec.source, spec.destination, spec.topology, options)
    figures.update(quantized_figures(plan, bf16, cluster))
    return bf16


def _plan_rows(plan: Plan, figures: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The readable table's rows every plan has: its bytes against the bound, its transfers,
    messages and buckets, and the layout and plan times."""
    s = plan.stats
    lb = max(s.lower_bound_bytes, 1)
    return [
        ("model (logical)", format_bytes(s.model_bytes), ""),
        ("destination pieces", format_bytes(s.dst_bytes), f"{s.dst_bytes / max(s.model_bytes, 1):.2f}x model"),
        ("lower bound, cross-domain", format_bytes(s.lower_bound_bytes), "1.000"),
        ("planned cross-domain", format_bytes(s.cross_domain_bytes), f"{s.cross_domain_bytes / lb:.3f}"),
        ("planned intra-domain", format_bytes(s.intra_domain_bytes),
         f"NVLink forwards (pipelined; relay {plan.options.relay})" if plan.relayed
         else f"NVLink fan-out (relay {plan.options.relay})"),
        ("planned local copies", format_bytes(s.local_bytes), ""),
        ("gather-and-broadcast", format_bytes(s.gather_broadcast_bytes), f"{s.gather_broadcast_bytes / lb:.2f}x bound"),
        ("busiest NIC send / recv", f"{format_bytes(s.max_send_bytes)} / {format_bytes(s.max_recv_bytes)}", ""),
        ("transfers net/intra/local", f"{s.num_network_transfers}/{s.num_intra_transfers}/{s.num_local_transfers}",
         ""),
        ("messages / rounds / buckets", f"{s.num_messages}/{s.num_rounds}/{s.num_buckets}", ""),
        ("layout build time", format_seconds(figures["layout_seconds"]), ""),
        ("plan time", format_seconds(figures["plan_seconds"]), ""),
    ]


def _cluster_rows(plan: Plan, prediction: Prediction | None,
                  deltas: list[DeltaPrediction]) -> list[tuple[str, str, str]]:
    """The readable table's rows for a cluster: the predicted seconds against the bound, and
    one row per ``--delta-density``."""
    lb = max(plan.stats.lower_bound_bytes, 1)
    rows = []
    if prediction:
        ratio = prediction.seconds / prediction.bound_seconds if prediction.bound_seconds > 0 else float("nan")
        rows.append((f"predicted on {prediction.cluster}", format_seconds(prediction.seconds),
                     f"bound {format_seconds(prediction.bound_seconds)} ({ratio:.2f}x)"))
    for d in deltas:
        rows.append((f"deltas at density {d.density:g}", format_seconds(d.seconds),
                     f"{format_bytes(d.wire_bytes)} cross-domain ({d.wire_bytes / lb:.3f} of the full bound)"))
    return rows


def _quantized_rows(plan: Plan, bf16: Plan, formats: TensorFormats,
                    figures: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The readable table's rows for a quantized destination format: the formats, the BF16
    plan's bytes (and seconds) beside this plan's, and the partial-amax exchange."""
    b = bf16.stats
    rows = [
        ("destination formats", ", ".join(sorted({f.name for _, f in formats.entries})),
         f"{len(formats)} tensors quantized"),
        ("bf16 plan, cross-domain", format_bytes(b.cross_domain_bytes),
         f"fp8 plan moves {plan.stats.cross_domain_bytes / max(b.cross_domain_bytes, 1):.3f}x"),
    ]
    if "bf16_predicted_seconds" in figures:
        rows.append(("bf16 plan, predicted", format_seconds(figures["bf16_predicted_seconds"]),
                     f"bound {format_seconds(figures['bf16_bound_seconds'])}"))
    if figures.get("amax_exchange_bytes"):
        rows.append(("partial-amax exchange", format_bytes(figures["amax_exchange_bytes"]),
                     f"{format_bytes(figures['amax_exchange_cross_domain_bytes'])} cross-domain (counted above)"))
    return rows


def _densities(value: str | None, cluster) -> list[float]:
    """``--delta-density``'s fractions (they need a cluster to predict on)."""
    if value is None:
        return []
    if cluster is None:
        raise ValueError("--delta-density predicts seconds: give a --cluster too")
    try:
        densities = [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--delta-density takes fractions like 0.02,0.05, got {value!r}") from None
    bad = [d for d in densities if not 0.0 <= d <= 1.0]
    if bad or not densities:
        raise ValueError(f"--delta-density fractions must be in [0, 1], got {value!r}")
    return densities
