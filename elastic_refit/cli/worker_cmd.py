"""`elastic-refit worker`: a synthetic member, to check a deployment end to end.

Started by a launcher (srun, a Kubernetes pod, a Ray actor, torchrun) with its identity in
the ``ELASTIC_REFIT_*`` environment (``RefitConfig.from_env``), it describes its own side
from a model preset (Megatron-style for trainers, vLLM-style for inference ranks, in its
side's rank space) or a side file (``--layout``, see ``load_side``) and runs the job: trainers publish versions ``1..N`` of deterministic
pattern data (the same bytes on every replica, and after a restart), inference ranks check
every byte of every version they serve. One line per version on stdout (``--json``: one JSON
object per line); exit status 0 once the last version is done, 3 if a byte was wrong (1: a
runtime fault, 2: bad input).

Restarts are safe: a trainer that comes back re-publishes versions the job already
committed with the same data (idempotent) and goes on from there; an inference rank picks
up the latest committed version.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

__all__ = ["WRONG_BYTES", "register", "run"]

# Exit status of an inference rank that served a wrong byte (1 is a runtime fault, 2 bad input):
# a launcher may restart a member after a fault, never after wrong bytes.
WRONG_BYTES = 3


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "worker", help="run a synthetic trainer or inference member (deployment smoke test)",
        description="A member of a refit job configured from ELASTIC_REFIT_* variables: trainers publish "
                    "pattern versions, inference ranks verify every byte.")
    parser.add_argument("--model", help="model preset name or a path to a HF config.json")
    parser.add_argument("--parallelism",
                        help="this side's parallelism: trainers e.g. tp=2,pp=2,ep=2; inference e.g. tp=2,dp=2")
    parser.add_argument("--layout", help="this side's layout file instead of a preset (see load_side)")
    parser.add_argument("--layers", type=int, default=None, help="cut the model to its first N layers")
    parser.add_argument("--versions", type=int, default=3, help="versions to refit (default 3)")
    parser.add_argument("--pause-s", type=float, default=0.0, help="trainers: seconds between versions")
    parser.add_argument("--metrics", metavar="HOST:PORT",
                        help="serve Prometheus metrics on this address (e.g. 0.0.0.0:9464; off by default)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.set_defaults(handler=run)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def side_layout(role: str, model: str | None, parallelism: str | None, layers: int | None,
                layout_file: str | None = None):
    """This member's side, described by itself: a side file, or a Megatron-style training or
    vLLM-style inference preset."""
    from elastic_refit.layout import load_side, megatron_layout, parse_parallelism, vllm_layout

    if layout_file is not None:
        return load_side(layout_file)
    if role == "trainer":
        return megatron_layout(model, parse_parallelism(parallelism, side="training"), num_layers=layers)
    return vllm_layout(model, parse_parallelism(parallelism, side="inference"), num_layers=layers)


def run(args: argparse.Namespace) -> int:
    from elastic_refit._validate import check_timeout
    from elastic_refit.runtime import ElasticRefit, RefitConfig
    from elastic_refit.testing.pattern import allocate, check_pieces, fill_pieces

    if args.versions < 1:
        raise ValueError(f"--versions must be >= 1, got {args.versions}")
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers must be >= 1, got {args.layers}")
    check_timeout("--pause-s", args.pause_s or None)
    if args.layout is not None and (args.model is not None or args.parallelism is not None):
        raise ValueError("give --layout, or --model with --parallelism, not both")
    if args.layout is None and (args.model is None or args.parallelism is None):
        raise ValueError("give --model and --parallelism (a preset of this side), or --layout FILE")
    config = RefitConfig.from_env()
    on_event = None
    if args.metrics is not None:
        from elastic_refit.runtime.metrics import RefitMetrics

        on_event = RefitMetrics()
        host, port = on_event.serve(args.metrics)
        print(f"elastic-refit: metrics on http://{host}:{port}/metrics", file=sys.stderr, flush=True)
    # A launcher stops a member with SIGTERM (Kubernetes, Slurm, torchelastic): leave the job
    # cleanly (the lease revoked, peers re-plan at once) instead of dying mid-way.
    signal.signal(signal.SIGTERM, _interrupt)
    layout = side_layout(config.role, args.model, args.parallelism, args.layers, args.layout)
    started = time.monotonic()

    def report(**fields: Any) -> None:
        fields = {"member_id": config.member_id, "role": config.role, "incarnation": config.incarnation, **fields,
                  "seconds": round(time.monotonic() - started, 3)}
        if args.json:
            print(json.dumps(fields), flush=True)
        else:
            print(" ".join(f"{k}={v}" for k, v in fields.items()), flush=True)

    if config.role == "trainer":
        with ElasticRefit(config, layout, on_event=on_event) as refit:
            for version in range(1, args.versions + 1):
                time.sleep(args.pause_s)
                tensors = allocate(layout, config.layout_rank, fill=0, device=config.device)
                fill_pieces(layout, config.layout_rank, tensors, seed=version)
                commit = refit.publish(tensors, version)
                report(event="committed", version=commit.version, epoch=commit.epoch)
        return 0
    params = allocate(layout, config.layout_rank, fill=0, device=config.device)
    failures = 0
    with ElasticRefit(config, layout, parameters=params, on_event=on_event) as refit:
        seen = 0
        while seen < args.versions:
            refit.wait_for_version(seen + 1)
            with refit.weights() as version:
                problems = check_pieces(layout, config.layout_rank, params, seed=version)
            failures += bool(problems)
            report(event="verified" if not problems else "wrong", version=version, problems=len(problems))
            if problems:
                print(f"elastic-refit: error: version {version}: {problems[0]}", file=sys.stderr, flush=True)
            seen = version
    return WRONG_BYTES if failures else 0
