"""The refit inside a real RL step: step breakdown per mode, generation paused, tokens/s.

    python benchmarks/bench_rl_step.py --out DIR                      # GPU: Qwen3 ~370 M, bf16, NCCL
    python benchmarks/bench_rl_step.py --device cpu --tiny --out DIR  # the same loop on the CPU (gloo)

A Qwen3 built from a transformers config (random weights; nothing downloaded) is trained
with a GRPO-style loss on synthetic rewards by ``--trainers`` FSDP2 processes and sampled
from by ``--engines`` processes running Hugging Face ``generate`` on their own full copies;
every rank is a process (on one GPU each has its own ``NCCL_HOSTID``: every byte crosses
NCCL's socket transport, as between hosts). The weights move after every step, in three
modes side by side in one run (``elastic_refit.testing.rl_step``): ``sync-gather`` (the
baseline, plain torch.distributed: gather whole tensors, broadcast from trainer 0),
``sync-reshard`` (``ElasticRefit`` in place, ``publish`` waits), ``async-staged``
(``ElasticRefit`` staged, ``publish(wait=False)`` one step ahead; the engines never stop).
Mid-run of the asynchronous mode the last engine is SIGKILLed during a refit and restarted.

Per step: train, refit (the trainer's call), generate (an engine's generate call), generation
paused (sync: from the end of training until the engines generate again; async: the staged
switch, ``refit.serving.paused``), step time; per mode the pool's tokens/s while weights
move into engines against the rest of the run; every served version checked against the
trainers' bits; the kill's recovery (kill -> next commit, restart -> serving). Where a
refit's cost to generation goes, in the asynchronous mode: the engines' CPU (the host's busy
fraction, the cores each thread uses, in refits and out: ``testing.cpu_sampler``) and, with
``--gil-profiler PY_SPY``, the seconds each thread of engine i0 held its GIL
(``testing.gil_sampler``). Writes ``DIR/summary.json``, ``DIR/trace.json`` (``elastic-refit
timeline`` of the members' logs) and the logs themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

GPU_MODEL = (("vocab_size", 32000), ("hidden_size", 1024), ("intermediate_size", 3072), ("num_hidden_layers", 24),
             ("num_attention_heads", 16), ("num_key_value_heads", 8), ("head_dim", 64),
             ("max_position_embeddings", 512))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for summary.json, trace.json and the members' logs")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--backend", default=None, help="the refit's transport (default: nccl4py on cuda, gloo on cpu)")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=4, help="prompts per generate call (each sampled --group times)")
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--modes", default="sync-gather,sync-reshard,async-staged")
    p.add_argument("--kill-at", type=int, default=4, help="async step whose refit loses the last engine (0: none)")
    p.add_argument("--timeout", type=float, default=540.0)
    p.add_argument("--gil-profiler", default=None, metavar="PY_SPY",
                   help="py-spy's path: sample which threads of engine i0 hold its GIL in the async mode")
    return p.parse_args(argv)


def _config(args: argparse.Namespace, etcd: str):
    from elastic_refit.testing.rl_model import TINY_QWEN3
    from elastic_refit.testing.rl_step import RLStepConfig

    model = TINY_QWEN3 if args.tiny else tuple((k, args.layers if k == "num_hidden_layers" else v) for k, v in GPU_MODEL)
    cuda = args.device == "cuda"
    return RLStepConfig(
        job=f"rl-{os.getpid()}", etcd=etcd, log_dir=str(Path(args.out) / "logs"), run_dir=str(Path(args.out) / "run"),
        port=_free_port(), device=args.device, backend=args.backend or ("nccl4py" if cuda else "gloo"), model=model,
        dtype="bfloat16" if cuda else "float32", num_trainers=args.trainers, num_inference=args.engines,
        steps=args.steps, prompts=args.prompts, group=args.group, prompt_len=args.prompt_len,
        new_tokens=args.new_tokens, modes=tuple(args.modes.split(",")), kill_at=args.kill_at or None,
        # Several processes share one machine (and one GPU): generous leases and timeouts.
        refit=(("ttl_s", 6), ("collective_timeout_s", 5.0), ("epoch_deadline_s", 30.0),
               ("bucket_bytes", 64 << 20), ("staging_bytes", 256 << 20)))


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.mean(values) if values else None


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def render(summary: dict) -> str:
    """The table: per mode, means over steps 2.. (step 1 warms up)."""
    lines = [f"{'mode':<14}{'train ms':>10}{'refit ms':>10}{'gen ms':>10}{'paused ms':>11}{'max paused':>11}"
             f"{'step ms':>10}{'tok/s refit':>12}{'tok/s idle':>11}{'ratio':>7}  verified"]
    for mode, m in summary["modes"].items():
        rows = [r for r in m["steps"] if r["step"] > 1] or m["steps"]
        th, v = m["throughput"], m["verified"]
        paused = [r["paused_s"] for r in rows if r["paused_s"] is not None]
        ratio = th.get("ratio")
        lines.append(f"{mode:<14}{_ms(_mean(rows, 'train_s')):>10}{_ms(_mean(rows, 'refit_s')):>10}"
                     f"{_ms(_mean(rows, 'generate_s')):>10}{_ms(_mean(rows, 'paused_s')):>11}"
                     f"{_ms(max(paused) if paused else None):>11}{_ms(_mean(rows, 'step_s')):>10}"
                     f"{th.get('tokens_per_s_refit') or 0:>12.0f}{th.get('tokens_per_s_idle') or 0:>11.0f}"
                     f"{'-' if ratio is None else f'{ratio:.2f}':>7}  "
                     f"{'yes' if v['ok'] else 'NO'} ({v['num_served']} served, {len(v['mismatches'])} bad)")
    for mode, m in summary["modes"].items():
        cpu = m.get("cpu") or {}
        if cpu.get("top"):
            busy = [cpu[k].get("host_busy") for k in ("refit", "idle")]
            lines.append(f"{mode} engines' CPU, cores in refits / idle (host {cpu['host_cores']} cores, busy "
                         + " / ".join("-" if b is None else f"{b:.0%}" for b in busy) + "): "
                         + ", ".join(f"{n} {a:.2f}/{b:.2f}" for n, a, b in cpu["top"]))
        gil = m.get("gil") or {}
        if gil.get("seconds_by_thread"):
            held = sorted(gil["seconds_by_thread"].items(), key=lambda kv: -kv[1])[:6]
            share = gil["runtime_over_refit"]
            lines.append(f"{mode} engine i0's GIL, seconds held over {gil['sampled_s']:.1f} s sampled ("
                         f"{gil['refit_s']:.1f} s of refits; the runtime's threads <= "
                         f"{'-' if share is None else f'{share:.0%}'} of refit time): "
                         + ", ".join(f"{n} {s:.2f}" for n, s in held))
        elif gil.get("error"):
            lines.append(f"{mode} engine i0's GIL: not sampled ({gil['error']})")
    kill = summary.get("kill")
    if kill:
        lines.append(f"kill {kill['member']} during the async refit of v{kill['after_step']}: next commit "
                     f"{_ms(kill['next_commit_s'])} ms (v{kill['next_commit_version']}); restarted -> joined "
                     f"{_ms(kill['restart_to_joined_s'])} ms, -> serving {_ms(kill['restart_to_serving_s'])} ms "
                     f"(versions {kill['restarted_served_versions']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from elastic_refit.cli.timeline_cmd import write_trace
    from elastic_refit.log import configure_logging
    from elastic_refit.testing import EtcdServer
    from elastic_refit.testing.rl_run import run_rl

    configure_logging(level=30)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    server = EtcdServer(name="rl-step")
    server.start()
    try:
        config = _config(args, server.endpoint)
        summary = run_rl(config, timeout_s=args.timeout, progress=lambda m: print(m, file=sys.stderr, flush=True),
                         gil_profiler=args.gil_profiler)
    finally:
        server.stop()
    summary["config"] = {k: getattr(config, k) for k in ("device", "backend", "dtype", "num_trainers", "num_inference",
                                                          "steps", "prompts", "group", "prompt_len", "new_tokens",
                                                          "kill_at")}
    summary["config"]["model"] = dict(config.model)
    summary["trace"] = write_trace([config.log_dir], Path(args.out) / "trace.json")
    summary["at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    Path(args.out, "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(render(summary))
    for error in summary["errors"]:
        print(f"! {error}", file=sys.stderr)
    ok = not summary["errors"] and all(m["verified"]["ok"] for m in summary["modes"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
