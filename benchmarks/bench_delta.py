"""Deltas (issue 35): how much of a policy changes per step, what that costs on the wire,
and what it buys a refit.

1. ``trajectory``: a Qwen3 built from a transformers config (random init), AdamW on fp32
   master weights, published as bf16 after every step, for each learning rate: per step
   the fraction of bf16 elements that changed and the bytes of the delta coding
   (``kernels.delta``) against the full bf16 bytes; encode and apply throughput (torch, this
   machine's CPU) beside a plain copy of the same bytes.
2. ``refit``: ``--ranks`` gloo processes of a tp/pp/ep -> tp/dp layout (relay off), one
   version per step for ``--steps`` steps, each version changing the measured density of
   the one before (``testing.versions``): per version the seconds of the full reshard and
   of the delta refit in the same run, the bytes each put on the wire against the full
   lower bound, every destination checked byte for byte against the version.

Run: ``python benchmarks/bench_delta.py [--hidden 512 --layers 4] [--skip-refit]``; it
prints one JSON object per part. The 2-core machine shared by several agents limits the
sizes; RESULTS.md says which ran.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from elastic_refit.kernels.delta import apply_delta, changed_elements, encode_delta

from elastic_refit.layout.models import ModelConfig
from elastic_refit.testing.pattern import allocate
from elastic_refit.testing.processes import run_local_world
from elastic_refit.testing.versions import version_buffers, version_problems
from elastic_refit.testing.world import RefitCase, make_transport
from elastic_refit.transport.executor import DeltaInputs, Executor, ExecutorOptions


def _qwen3(hidden: int, layers: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(hidden // 64, 1), num_key_value_heads=max(hidden // 128, 1),
                         head_dim=64, vocab_size=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).float()


def trajectory(hidden: int, layers: int, steps: int, lrs: list[float]) -> dict:
    """Train a few steps per learning rate; per step the changed fraction of the bf16
    weights and the delta's bytes over the full bytes."""
    out = {"hidden": hidden, "layers": layers, "steps": steps, "runs": []}
    for lr in lrs:
        model = _qwen3(hidden, layers)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        prev = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
        out["bytes"] = sum(t.numel() * 2 for t in prev.values())
        g = torch.Generator().manual_seed(1)
        per_step = []
        for _ in range(steps):
            ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=g)
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            cur = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
            changed = coded = full = 0
            for n, t in cur.items():
                a, b = t.contiguous().view(torch.uint8).reshape(-1), prev[n].contiguous().view(torch.uint8).reshape(-1)
                idx = changed_elements(a, b, 2)
                changed += idx.numel()
                coded += encode_delta(a, b, 2, changed=idx).numel()
                full += a.numel()
            per_step.append({"changed_fraction": changed / (full // 2), "wire_fraction": coded / full})
            prev = cur
        out["runs"].append({"lr": lr, "per_step": per_step})
    return out


def codec_speed(nbytes: int, density: float) -> dict:
    """Encode and apply over ``nbytes`` of bf16 at ``density``, beside a plain copy."""
    g = torch.Generator().manual_seed(2)
    base = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    cur = base.clone()
    mask = torch.rand(nbytes // 2, generator=g) < density
    cur.view(torch.int16)[mask] += 1
    target = base.clone()

    def timed(fn, repeat=3):
        fn()
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - t0) / repeat

    payload = encode_delta(cur, base, 2)
    copy_s = timed(lambda: target.copy_(cur))
    encode_s = timed(lambda: encode_delta(cur, base, 2))
    apply_s = timed(lambda: apply_delta(payload, target, 2))
    return {"bytes": nbytes, "density": density, "copy_gbps": nbytes / copy_s / 1e9,
            "encode_gbps": nbytes / encode_s / 1e9, "apply_gbps": nbytes / apply_s / 1e9}


def _refit_rank(rank: int, world_size: int, store: dist.Store, case: RefitCase, steps: int, density: float) -> dict:
    torch.set_num_threads(1)
    plan = case.plan()
    transport = make_transport(dist.PrefixStore("bench", store), rank, world_size, "gloo", 120.0)
    executor = Executor(plan, transport, ExecutorOptions(verify=True, delta=True, staging_bytes=256 << 20))
    receivers = frozenset(plan.destination.ranks)
    dst = allocate(plan.destination, rank, fill=0)
    src = version_buffers(plan.source, rank, 0, density=density)
    executor.run(src, dst)  # version 0 in full (and the connections warm)
    rows, problems = [], []
    for version in range(1, steps + 1):
        base = src
        src = version_buffers(plan.source, rank, version, density=density)
        back = {n: t.clone() for n, t in dst.items()}
        transport.vote(True)  # line up before timing
        full = executor.run(src, dst)
        for n, t in dst.items():  # back to the base, then the same version as a delta
            t.copy_(back[n])
        transport.vote(True)
        delta = executor.run(src, dst, delta=DeltaInputs(base, receivers))
        problems += version_problems(plan.destination, rank, dst, version, density=density)
        rows.append({"full_s": full.seconds, "delta_s": delta.seconds, "sent": full.network_send_bytes,
                     "saved": delta.network_saved_bytes})
    transport.abort()
    return {"rows": rows, "problems": problems}


def refit(case: RefitCase, steps: int, density: float) -> dict:
    plan = case.plan()
    world = plan.topology.num_ranks
    results = run_local_world(_refit_rank, world, (case, steps, density), timeout_s=3000)
    by_rank = {r.rank: r.value for r in results}
    per_version = []
    for v in range(steps):
        rows = [by_rank[r]["rows"][v] for r in by_rank]
        sent = sum(r["sent"] for r in rows)
        per_version.append({"version": v + 1, "full_s": max(r["full_s"] for r in rows),
                            "delta_s": max(r["delta_s"] for r in rows),
                            "wire_over_bound": (sent - sum(r["saved"] for r in rows)) / plan.stats.lower_bound_bytes})
    return {"ranks": world, "lower_bound_bytes": plan.stats.lower_bound_bytes, "density": density,
            "problems": [p for r in by_rank for p in by_rank[r]["problems"]], "per_version": per_version}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lrs", default="1e-6,3e-6,1e-5")
    p.add_argument("--codec-mib", type=int, default=64)
    p.add_argument("--refit-hidden", type=int, default=512)
    p.add_argument("--refit-layers", type=int, default=4)
    p.add_argument("--skip-refit", action="store_true")
    args = p.parse_args()
    traj = trajectory(args.hidden, args.layers, args.steps, [float(x) for x in args.lrs.split(",")])
    print(json.dumps({"trajectory": traj}))
    density = max(s["changed_fraction"] for s in traj["runs"][0]["per_step"])
    print(json.dumps({"codec": codec_speed(args.codec_mib << 20, density)}))
    if args.skip_refit:
        return
    model = ModelConfig(name="bench-qwen3-moe", hidden_size=args.refit_hidden, num_layers=args.refit_layers,
                        vocab_size=8192, num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=0,
                        num_experts=8, moe_intermediate_size=args.refit_hidden, qk_norm=True)
    case = RefitCase(model=model, source="tp=1,pp=2,dp=2,ep=2", destination="tp=2,dp=2", domain_size=1,
                     bucket_bytes=16 << 20, relay="off")
    print(json.dumps({"refit": refit(case, args.steps, density)}))


if __name__ == "__main__":
    main()
