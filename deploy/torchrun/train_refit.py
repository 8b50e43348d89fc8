"""A trainer started by torchrun that refits every step: what a torchelastic job adds to its loop.

    ELASTIC_REFIT_JOB=myjob ELASTIC_REFIT_ROLE=trainer ELASTIC_REFIT_ETCD=etcd-0:2379 \\
      torchrun --nnodes 1 --nproc-per-node 2 --max-restarts 3 deploy/torchrun/train_refit.py \\
        --model deploy/smoke-model.json --parallelism tp=2 --versions 100

Nothing else is configured: ``RefitConfig.from_env`` takes the member id (``trainer-{RANK}``),
the layout rank (``RANK``), the domain (``node-{GROUP_RANK}``) and a new incarnation per
torchelastic restart from torchrun's environment. The trainers' own process group (gloo
here, NCCL on GPUs) is torchrun's; the refit builds its communicator separately, so a refit
never blocks a training collective and a training collective never sees a refit peer.

The "training step" is an all-reduce in the trainers' own group plus deterministic pattern
data in the layout's buffers (so every inference rank can check every byte); replace both
with your model. After a restart the loop starts again at version 1: versions the job
committed already come back at once (a repeat with the same data), and the job goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--parallelism", required=True, help="the trainers' parallelism, e.g. tp=2")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--pause-s", type=float, default=0.5, help="seconds of 'training' per step")
    parser.add_argument("--no-trainer-group", action="store_true",
                        help="skip the trainers' own process group and its all-reduce per step")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    from elastic_refit import ElasticRefit, RefitConfig
    from elastic_refit.layout import megatron_layout, parse_parallelism
    from elastic_refit.log import configure_logging
    from elastic_refit.testing.pattern import allocate, fill_pieces

    configure_logging()  # JSON lines on stderr
    config = RefitConfig.from_env()

    def report(**fields) -> None:
        # One write(2) per line: the ranks share torchrun's stdout, and two ranks reporting
        # the same commit at once must not interleave their lines (a pipe keeps a write of
        # under PIPE_BUF bytes whole).
        line = json.dumps({"member_id": config.member_id, "pid": os.getpid(), **fields}) + "\n"
        os.write(sys.stdout.fileno(), line.encode())

    report(event="started", incarnation=config.incarnation, restart=int(os.environ["TORCHELASTIC_RESTART_COUNT"]))
    own_group = not args.no_trainer_group
    if own_group:
        dist.init_process_group("gloo")  # torchrun's rendezvous: the trainers' own group
    layout = megatron_layout(args.model, parse_parallelism(args.parallelism, side="training"),
                             num_layers=args.layers)
    with ElasticRefit(config, layout) as refit:
        for version in range(1, args.versions + 1):
            grad = torch.ones(4)
            if own_group:
                dist.all_reduce(grad)  # a training step's collective, in the trainers' own group
            else:
                grad *= int(os.environ["WORLD_SIZE"])
            time.sleep(args.pause_s)
            tensors = allocate(layout, config.layout_rank, fill=0)
            fill_pieces(layout, config.layout_rank, tensors, seed=version)
            commit = refit.publish(tensors, version)
            # commit.version can be newer than version: a version overtaken by a newer one
            # before it moved is not sent on its own (inference wants the latest).
            report(event="committed", version=commit.version, published=version, epoch=commit.epoch,
                   world=int(grad[0]))
    if own_group:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
