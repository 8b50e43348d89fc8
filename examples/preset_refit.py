"""Megatron-style trainers -> vLLM-style engine, each side described by a preset of its own.

    python examples/preset_refit.py [--model deploy/smoke-model.json] [--train tp=2,pp=2] [--serve tp=2] [--versions 3]

The trainers know only their own parallelism (``megatron_layout(model, "tp=2,pp=2")``: fused
QKV and gate/up per TP rank, stacked experts, pipeline stages), the engine only its own
(``vllm_layout(model, "tp=2")``); each builds its layout in its own side's rank space and the
runtime plans the refit from the two layouts in etcd. The members run as threads of this
process for brevity (real jobs run one process per GPU: deploy/). Buffers hold deterministic
pattern data (``elastic_refit.testing.pattern``) so the engine can check every byte of every
version; in a real job they are the Megatron model's parameters and the engine's weights.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import uuid
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "deploy" / "smoke-model.json"))
    parser.add_argument("--train", default="tp=2,pp=2", help="the trainers' parallelism (Megatron)")
    parser.add_argument("--serve", default="tp=2", help="the engine's parallelism (vLLM)")
    parser.add_argument("--versions", type=int, default=3)
    args = parser.parse_args(argv)

    from elastic_refit import ElasticRefit, RefitConfig
    from elastic_refit.layout import megatron_layout, parse_parallelism, vllm_layout
    from elastic_refit.log import configure_logging
    from elastic_refit.testing import EtcdServer
    from elastic_refit.testing.pattern import allocate, check_pieces, fill_pieces

    configure_logging(level=30)  # warnings only
    train = megatron_layout(args.model, parse_parallelism(args.train, side="training"))
    serve = vllm_layout(args.model, parse_parallelism(args.serve, side="inference"))
    server = EtcdServer(name="preset-refit")
    server.start()
    job, results, errors = f"preset-{uuid.uuid4().hex[:6]}", [], []

    def config(role: str, rank: int) -> RefitConfig:
        return RefitConfig(job=job, role=role, member_id=f"{role}-{rank}", layout_rank=rank, etcd=(server.endpoint,),
                           domain="train" if role == "trainer" else f"serve-{rank}")

    def trainer(rank: int) -> None:
        with ElasticRefit(config("trainer", rank), train) as refit:  # the training side only
            for version in range(1, args.versions + 1):
                buffers = allocate(train, rank, fill=0)  # a Megatron rank's parameters
                fill_pieces(train, rank, buffers, seed=version)
                refit.publish(buffers, version)

    def engine(rank: int) -> None:
        params = allocate(serve, rank, fill=0)  # an engine rank's weights
        with ElasticRefit(config("inference", rank), serve, parameters=params) as refit:  # the engine side only
            for version in range(1, args.versions + 1):
                refit.wait_for_version(version)
                with refit.weights() as serving:
                    problems = check_pieces(serve, rank, params, seed=serving)
                results.append((serving, rank, len(problems)))

    def run(target, rank: int) -> None:
        try:
            target(rank)
        except Exception as exc:  # reported below
            errors.append(f"{target.__name__} {rank}: {type(exc).__name__}: {exc}")

    start = time.monotonic()
    threads = [threading.Thread(target=run, args=(trainer, r)) for r in train.ranks]
    threads += [threading.Thread(target=run, args=(engine, r)) for r in serve.ranks]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        server.stop()
    print(f"{len(train.ranks)} Megatron ranks ({args.train}) -> {len(serve.ranks)} vLLM ranks ({args.serve}), "
          f"{train.model_nbytes} bytes per version")
    print(f"{'version':>7}  {'engine rank':>11}  {'wrong boxes':>11}")
    for version, rank, wrong in sorted(results):
        print(f"{version:>7}  {rank:>11}  {wrong:>11}")
    ok = not errors and len(results) == args.versions * len(serve.ranks) and all(w == 0 for *_, w in results)
    for error in errors:
        print(error, file=sys.stderr)
    print(f"{'OK' if ok else 'FAILED'}: every byte of every version checked on every engine rank "
          f"({time.monotonic() - start:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
