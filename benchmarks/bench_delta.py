"""Deltas (issue 35): how much of a policy changes per step, what that costs on the wire,
and what it buys a refit.

1. ``trajectory``: a Qwen3 built from a transformers config (random init), AdamW on fp32
   master weights, published as bf16 after every step, for each learning rate: per step
   the fraction of bf16 elements that changed and the bytes of the delta coding
   (``kernels.delta``) against the full bf16 bytes; encode and apply throughput (torch, this
   machine's CPU) beside a plain copy of the same bytes.
2. ``refit``: 8 gloo processes of a tp/pp/ep -> tp/dp layout (a Qwen3-MoE from
   ``--refit-hidden/--refit-layers/--refit-experts``), one version per step for ``--steps``
   steps. The versions are the trained trajectory at ``--refit-lr`` mapped onto the layout
   (every tensor reads the published bf16 weights of the trained model from its own start,
   wrapping around: the changes are where training changed weights) or, with
   ``--synthetic``, ``testing.versions`` at the measured density. Per version, in the same
   run: the seconds of the full reshard, of gather-and-broadcast and of the delta refit,
   the changed fraction, the bytes the delta put on the wire against the full lower bound,
   every destination checked byte for byte against the version.

3. ``codec`` on CUDA (``--device cuda``): encode and apply over ``--codec-mib`` of bf16 at
   the trajectory's densities (per learning rate, its median changed fraction), timed with
   CUDA events beside a plain device copy of the same bytes: the fused Triton kernels
   (``kernels.delta_triton``: compare + compaction of positions and values; scatter), the
   torch reference (``nonzero`` + gather; ``index_copy_``) and the executor's box codec
   (``transport.delta_boxes`` segments with digest moves, over a whole buffer and over half
   its columns), each result checked bit for bit. Goals (issue 35): encode >= 50% of the
   copy's bandwidth, apply >= 80%.

With ``--device cuda --backend nccl4py`` the refit runs its 8 ranks as processes sharing GPU
0, each its own NCCL host (``testing.processes.nccl_rank_env``: every byte crosses NCCL's
socket transport on loopback), buffers on the GPU.

Run: ``python benchmarks/bench_delta.py [--refit-hidden 1024 --refit-layers 4]
[--skip-trajectory] [--synthetic] [--device cuda --backend nccl4py] [--json]``; it prints a
table per part (and one JSON object per part with ``--json``). The 2-core machine shared by
several agents limits the CPU sizes; RESULTS.md says which ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from elastic_refit.kernels.delta import apply_delta, changed_elements, encode_delta

from elastic_refit.layout.models import ModelConfig
from elastic_refit.testing.pattern import allocate
from elastic_refit.testing.processes import nccl_rank_env, run_local_world
from elastic_refit.testing.versions import version_buffers
from elastic_refit.testing.world import RefitCase, make_transport
from elastic_refit.transport.executor import DeltaInputs, Executor, ExecutorOptions


def _qwen3(hidden: int, layers: int, device: str = "cpu"):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(hidden // 64, 1), num_key_value_heads=max(hidden // 128, 1),
                         head_dim=64, vocab_size=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).float().to(device)


def trajectory(hidden: int, layers: int, steps: int, lrs: list[float], device: str = "cpu") -> dict:
    """Train a few steps per learning rate; per step the changed fraction of the bf16
    weights and the delta's bytes over the full bytes."""
    out = {"hidden": hidden, "layers": layers, "steps": steps, "device": device, "runs": []}
    for lr in lrs:
        model = _qwen3(hidden, layers, device)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        prev = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
        out["bytes"] = sum(t.numel() * 2 for t in prev.values())
        g = torch.Generator().manual_seed(1)
        per_step = []
        for _ in range(steps):
            ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=g).to(device)
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
    """Encode and apply over ``nbytes`` of bf16 at ``density``, beside a plain copy: the
    torch reference codec (``kernels.delta``, one flat run) and the executor's box codec
    (``transport.delta_boxes``: compiled on the CPU when built) over a whole buffer and over
    half its columns (a TP shard's box)."""
    from types import SimpleNamespace

    from elastic_refit.transport.delta_boxes import Boxes, Segments
    from elastic_refit.transport.schedule import BoxCopy

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
    out = {"bytes": nbytes, "density": density, "copy_gbps": nbytes / copy_s / 1e9,
           "torch_encode_gbps": nbytes / timed(lambda: encode_delta(cur, base, 2)) / 1e9,
           "torch_apply_gbps": nbytes / timed(lambda: apply_delta(payload, target, 2)) / 1e9}
    cols = 1024
    rows = nbytes // 2 // cols
    shape = (rows, cols)
    ref = (0, "w")
    schedule = SimpleNamespace(buffers={ref: SimpleNamespace(shape=shape, dtype="bfloat16")})
    tensors = {ref: cur[: rows * cols * 2].view(torch.bfloat16).view(shape)}
    bases = {ref: base[: rows * cols * 2].view(torch.bfloat16).view(shape)}
    for name, box in (("box", BoxCopy(ref, (0, 0), shape, 0, rows * cols * 2)),
                      ("half_box", BoxCopy(ref, (0, cols // 2), (rows, cols // 2), 0, rows * cols))):
        boxes = Boxes((box,), schedule, torch.device("cpu"))
        seg = boxes.segments(tensors, bases, True)
        dst = {ref: bases[ref].clone()}
        sized = box.nbytes
        out[f"{name}_encode_gbps"] = sized / timed(lambda b=boxes: b.segments(tensors, bases, True)) / 1e9
        out[f"{name}_apply_gbps"] = sized / timed(
            lambda b=boxes, s=seg, d=dst: b.apply_segments(d, Segments(s.entries, s.value_bytes, s.coded, s.moves),
                                                          True)[1].finish(True)) / 1e9
        out[f"{name}_coded_fraction"] = seg.coded.numel() / sized
    return out


def trajectory_streams(hidden: int, layers: int, steps: int, lr: float, device: str = "cpu") -> list[torch.Tensor]:
    """Per version 0..steps: the published bf16 weights of a trained Qwen3 (AdamW on fp32
    masters), all parameters back to back, as int16 on the CPU (the refit's versions are
    made of them)."""
    model = _qwen3(hidden, layers, device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)

    def flat() -> torch.Tensor:
        return torch.cat([p.detach().to(torch.bfloat16).reshape(-1) for p in model.parameters()]).view(torch.int16).cpu()

    out = [flat()]
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=g).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(flat())
    return out


def stream_buffers(layout, rank: int, stream: torch.Tensor, fill: int = 0) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s buffers of ``layout`` (2-byte tensors) holding the version ``stream``
    is: each tensor reads the stream from its own start (a hash of its name), element after
    element, wrapping around, so every rank and side derives the same global tensors and a
    version changes where the trained weights changed. Built where ``stream`` is (on the GPU
    for a CUDA stream)."""
    import zlib

    from elastic_refit.testing.pattern import _local_view, _pieces_of

    device = stream.device
    out = allocate(layout, rank, fill=fill, device=device)
    n = stream.numel()
    for _, t, buffer, off, ln, loff, lln in _pieces_of(layout, rank):
        if t.itemsize != 2:
            raise ValueError(f"stream_buffers fills 2-byte tensors, {t.name!r} has {t.itemsize}-byte elements")
        strides = [1] * len(t.shape)
        for d in range(len(t.shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * t.shape[d + 1]
        index = torch.tensor(zlib.crc32(t.name.encode()) % n, dtype=torch.int64, device=device)
        for d, (o, m) in enumerate(zip(off, ln, strict=True)):
            index = index.unsqueeze(-1) + (torch.arange(o, o + m, device=device) * strides[d]).view(*([1] * d), m)
        region = _local_view(out[buffer], loff, lln, t.itemsize)
        region.copy_(stream[index.remainder_(n)].view(torch.uint8).reshape(region.shape))
    return out


def _refit_rank(rank: int, world_size: int, store: dist.Store, case: RefitCase, steps: int, density: float,
                streams: list[torch.Tensor] | None, backend: str = "gloo") -> dict:
    from elastic_refit.transport.baseline import BaselineOptions, GatherBroadcast

    torch.set_num_threads(1)
    plan = case.plan()
    transport = make_transport(dist.PrefixStore("bench", store), rank, world_size, backend, 300.0)
    device = transport.device  # the GPU nccl_rank_env gave this rank, or the CPU
    if device.type == "cuda":  # as a runtime member does before it joins: no compile inside a timed refit
        from elastic_refit.kernels import warm_up

        warm_up(device, deltas=True)
    executor = Executor(plan, transport, ExecutorOptions(verify=True, delta=True, staging_bytes=256 << 20))
    baseline = GatherBroadcast(plan, transport, BaselineOptions(chunk_bytes=8 << 20))
    receivers = frozenset(plan.destination.ranks)
    streams = None if streams is None else [s.to(device) for s in streams]

    def version(layout, v: int, fill: int = 0) -> dict:
        if streams is None:
            return version_buffers(layout, rank, v, density=density, fill=fill, device=device)
        return stream_buffers(layout, rank, streams[v], fill=fill)

    dst = allocate(plan.destination, rank, fill=0, device=device)
    src = version(plan.source, 0)
    executor.warm(src, dst)  # as the runtime does on entering an epoch (the delta codec's kernels too)
    executor.run(src, dst)  # version 0 in full (and the connections warm)
    rows, problems = [], []
    for v in range(1, steps + 1):
        base = src
        src = version(plan.source, v)
        back = {n: t.clone() for n, t in dst.items()}
        transport.vote(True)  # line up before timing
        full = executor.run(src, dst)
        for n, t in dst.items():  # back to the base, then the same version by gather-and-broadcast
            t.copy_(back[n])
        transport.vote(True)
        gather = baseline.run(src, dst)
        for n, t in dst.items():  # back to the base, then the same version as a delta
            t.copy_(back[n])
        transport.vote(True)
        delta = executor.run(src, dst, delta=DeltaInputs(base, receivers))
        want = version(plan.destination, v)
        problems += [f"rank {rank} version {v} buffer {n!r}: {int((t.view(torch.uint8) != want[n].view(torch.uint8)).sum())} "
                     "bytes differ" for n, t in dst.items() if not torch.equal(t.view(torch.uint8), want[n].view(torch.uint8))]
        rows.append({"full_s": full.seconds, "gather_s": gather.seconds, "delta_s": delta.seconds,
                     "sent": full.network_send_bytes + full.intra_send_bytes,
                     "saved": delta.network_saved_bytes + delta.intra_saved_bytes,
                     "changed": _changed(base, src) if rank in plan.source.ranks else (0, 0)})
        del back, want
    transport.abort()
    return {"rows": rows, "problems": problems}


def _changed(base: dict, src: dict) -> tuple[int, int]:
    """(changed 2-byte elements, elements) of this rank's source buffers."""
    changed = total = 0
    for n, t in src.items():
        a, b = t.view(torch.int16).reshape(-1), base[n].view(torch.int16).reshape(-1)
        changed += int((a != b).sum())
        total += a.numel()
    return changed, total


def refit_case(hidden: int, layers: int, experts: int) -> RefitCase:
    """The refit part's layout: a Qwen3-MoE, tp1,pp2,dp2,ep2 -> tp2,dp2 on 8 ranks."""
    model = ModelConfig(name="bench-qwen3-moe", hidden_size=hidden, num_layers=layers, vocab_size=8192, num_heads=8,
                        num_kv_heads=4, head_dim=64, intermediate_size=0, num_experts=experts,
                        moe_intermediate_size=hidden, qk_norm=True)
    return RefitCase(model=model, source="tp=1,pp=2,dp=2,ep=2", destination="tp=2,dp=2", domain_size=1,
                     bucket_bytes=16 << 20, relay="off")


def refit(case: RefitCase, steps: int, density: float, streams: list[torch.Tensor] | None = None,
          backend: str = "gloo") -> dict:
    """The refit table (see the module): 8 processes on ``backend`` (on GPU 0 for NCCL)."""
    plan = case.plan()
    world = plan.topology.num_ranks
    results = run_local_world(_refit_rank, world, (case, steps, density, streams, backend), timeout_s=3000,
                              rank_env=None if backend == "gloo" else nccl_rank_env)
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError("refit ranks failed: " + "; ".join(
            f"rank {r.rank}: {r.error_type} {r.error[:1500]} (exit {r.exitcode})" for r in failed))
    by_rank = {r.rank: r.value for r in results}
    per_version = []
    bound = plan.stats.lower_bound_bytes
    for v in range(steps):
        rows = [by_rank[r]["rows"][v] for r in by_rank]
        sent = sum(r["sent"] for r in rows)
        full_s, delta_s = max(r["full_s"] for r in rows), max(r["delta_s"] for r in rows)
        changed = sum(r["changed"][0] for r in rows) / max(1, sum(r["changed"][1] for r in rows))
        per_version.append({"version": v + 1, "changed_fraction": round(changed, 5), "full_s": round(full_s, 4),
                            "gather_s": round(max(r["gather_s"] for r in rows), 4), "delta_s": round(delta_s, 4),
                            "speedup": round(full_s / delta_s, 2),
                            "wire_over_bound": round((sent - sum(r["saved"] for r in rows)) / bound, 5)})
    return {"ranks": world, "backend": backend, "lower_bound_bytes": bound,
            "density": density if streams is None else "trajectory",
            "problems": [p for r in by_rank for p in by_rank[r]["problems"]], "per_version": per_version}


# ---- the codec on CUDA -------------------------------------------------------------------------
def _cuda_seconds(fn, repeat: int) -> float:
    """Median seconds of ``fn`` between two CUDA events (after one warm-up call): kernels
    and any host synchronisation inside ``fn`` (an encode reads its output's size)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _flat_rows(cur: torch.Tensor, base: torch.Tensor, repeat: int) -> tuple[dict, bool]:
    """Seconds of the fused kernels and of the torch reference over flat int16 runs; and
    whether every result was bit-exact."""
    from elastic_refit.kernels import delta_triton

    target = base.clone()
    out = {"copy": _cuda_seconds(lambda: target.copy_(cur), repeat)}
    index, values = delta_triton.encode_changes(cur, base)

    def reference():
        i = (cur != base).nonzero().flatten()
        return i, cur.index_select(0, i)

    ref_i, ref_v = reference()
    exact = torch.equal(index, ref_i) and torch.equal(values, ref_v)
    del ref_i, ref_v
    out["triton_encode"] = _cuda_seconds(lambda: delta_triton.encode_changes(cur, base), repeat)
    out["torch_encode"] = _cuda_seconds(reference, repeat)
    target.copy_(base)
    out["triton_apply"] = _cuda_seconds(lambda: delta_triton.scatter(target, index, values), repeat)
    exact = exact and torch.equal(target, cur)
    target.copy_(base)
    out["torch_apply"] = _cuda_seconds(lambda: target.index_copy_(0, index, values), repeat)
    exact = exact and torch.equal(target, cur)
    return out, exact


def _box_rows(cur: torch.Tensor, base: torch.Tensor, repeat: int) -> tuple[dict, bool]:
    """Seconds of the executor's box codec on CUDA (segments with digest moves; kernels on)
    over the run as a [rows, 1024] buffer, whole and half its columns; bit-exactness."""
    from types import SimpleNamespace

    from elastic_refit.transport.delta_boxes import Boxes
    from elastic_refit.transport.schedule import BoxCopy

    cols = 1024
    rows = cur.numel() // cols
    ref, shape = (0, "w"), (rows, cols)
    schedule = SimpleNamespace(buffers={ref: SimpleNamespace(shape=shape, dtype="bfloat16")})
    tensors = {ref: cur[: rows * cols].view(torch.bfloat16).view(shape)}
    bases = {ref: base[: rows * cols].view(torch.bfloat16).view(shape)}
    out, exact = {}, True
    for name, box in (("box", BoxCopy(ref, (0, 0), shape, 0, rows * cols * 2)),
                      ("half_box", BoxCopy(ref, (0, cols // 2), (rows, cols // 2), 0, rows * cols))):
        boxes = Boxes((box,), schedule, cur.device)
        seg = boxes.segments(tensors, bases, True)
        scale = (rows * cols * 2) / box.nbytes  # seconds per byte of the box, scaled to the run
        out[f"{name}_encode"] = _cuda_seconds(lambda b=boxes: b.segments(tensors, bases, True), repeat) * scale
        dst = {ref: bases[ref].clone()}
        moves, written = boxes.apply_segments(dst, seg, True)  # the base's digest moves: checked
        exact = exact and torch.equal(moves.cpu(), seg.moves.cpu())
        written.finish(True)
        # Timed again on what it wrote: the same check and writes (rewriting equal bytes).
        out[f"{name}_apply"] = _cuda_seconds(
            lambda b=boxes, s=seg, d=dst: b.apply_segments(d, s, True)[1].finish(True), repeat) * scale
        region = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))
        exact = exact and torch.equal(dst[ref][region].view(torch.int16), tensors[ref][region].view(torch.int16))
        out[f"{name}_coded_fraction"] = seg.coded.numel() / box.nbytes
        del seg, dst
    return out, exact


def codec_gpu(nbytes: int, density: float, repeat: int = 5) -> dict:
    """One row of the CUDA codec table: ``nbytes`` of bf16 (int16 views), a ``density`` of
    elements changed; seconds turned into GB/s of the weights (``nbytes / s``) and fractions
    of the copy's."""
    from elastic_refit.kernels import delta_triton

    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device here")
    if not delta_triton.HAVE_TRITON:
        raise RuntimeError("--device cuda: triton does not import, the fused delta kernels cannot run")
    g = torch.Generator(device="cuda").manual_seed(2)
    n = nbytes // 2
    base = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, device="cuda", generator=g)
    cur = base.clone()
    cur[torch.rand(n, device="cuda", generator=g) < density] += 1
    changed = int((cur != base).sum())
    seconds, exact = _flat_rows(cur, base, repeat)
    boxes, box_exact = _box_rows(cur, base, repeat)
    seconds.update({k: v for k, v in boxes.items() if not k.endswith("fraction")})
    del cur, base
    torch.cuda.empty_cache()
    row = {"bytes": nbytes, "density": density, "changed_fraction": changed / n, "bit_exact": exact and box_exact,
           "coded_fraction": boxes["box_coded_fraction"]}
    row.update({f"{k}_gbps": nbytes / s / 1e9 for k, s in seconds.items()})
    copy = seconds["copy"]
    row.update({f"{k}_of_copy": copy / s for k, s in seconds.items() if k != "copy"})
    return row


def _print_codec_table(rows: list[dict]) -> None:
    cols = ["triton_encode", "torch_encode", "box_encode", "half_box_encode", "triton_apply", "torch_apply",
            "box_apply", "half_box_apply"]
    print("\ncodec on CUDA: GB/s of weights (fraction of a plain copy of the same bytes); goals: encode >= 0.5, "
          "apply >= 0.8")
    print("| MiB | changed | copy GB/s | " + " | ".join(cols) + " | exact |")
    print("|---" * (len(cols) + 4) + "|")
    for r in rows:
        cells = [f"{r[c + '_gbps']:.0f} ({r[c + '_of_copy']:.2f})" for c in cols]
        print(f"| {r['bytes'] >> 20} | {r['changed_fraction']:.2%} | {r['copy_gbps']:.0f} | " + " | ".join(cells)
              + f" | {r['bit_exact']} |", flush=True)


def _print_refit_table(res: dict) -> None:
    print(f"\nrefit: {res['ranks']} ranks on {res['backend']}, lower bound {res['lower_bound_bytes'] / 1e6:.1f} MB, "
          f"versions {res['density']}, problems: {res['problems'][:3] or 'none'}")
    print("| version | changed | full reshard s | gather-and-broadcast s | delta s | full / delta | wire / full bound |")
    print("|---|---|---|---|---|---|---|")
    for r in res["per_version"]:
        print(f"| {r['version']} | {r['changed_fraction']:.2%} | {r['full_s']:.3f} | {r['gather_s']:.3f} | "
              f"{r['delta_s']:.3f} | {r['speedup']:.2f} | {r['wire_over_bound']:.2%} |", flush=True)


def _print_trajectory(traj: dict) -> None:
    print(f"\ntrajectory: Qwen3 hidden {traj['hidden']}, {traj['layers']} layers, {traj['bytes'] / 1e6:.1f} MB bf16, "
          f"{traj['steps']} steps on {traj['device']}: changed elements / coded bytes, step 1 -> last")
    for run in traj["runs"]:
        first, last = run["per_step"][0], run["per_step"][-1]
        print(f"  lr {run['lr']:g}: {first['changed_fraction']:.2%} -> {last['changed_fraction']:.2%} / "
              f"{first['wire_fraction']:.2%} -> {last['wire_fraction']:.2%}", flush=True)


def _emit(args, key: str, value) -> None:
    if args.json:
        print(json.dumps({key: value}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lrs", default="1e-6,3e-6,1e-5")
    p.add_argument("--codec-mib", default=None,
                   help="sizes of the codec runs, comma-separated (default 64 on the CPU, 256,2048 on CUDA)")
    p.add_argument("--refit-hidden", type=int, default=512)
    p.add_argument("--refit-layers", type=int, default=4)
    p.add_argument("--refit-experts", type=int, default=8)
    p.add_argument("--refit-lr", type=float, default=1e-6,
                   help="the refit's versions are the trajectory at this lr, mapped onto the layout")
    p.add_argument("--synthetic", action="store_true",
                   help="synthetic versions (testing.versions at the trajectory's density) instead of the trajectory")
    p.add_argument("--skip-trajectory", action="store_true", help="no trajectory table, no codec figures")
    p.add_argument("--skip-refit", action="store_true")
    p.add_argument("--codec-only", action="store_true", help="the trajectory and the codec table only (no refit)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--backend", default=None, help="the refit's transport (default gloo on the CPU, nccl4py on CUDA)")
    p.add_argument("--json", action="store_true", help="also print one JSON object per part")
    args = p.parse_args()
    backend = args.backend or ("gloo" if args.device == "cpu" else "nccl4py")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    densities = [0.02]
    if not args.skip_trajectory:
        traj = trajectory(args.hidden, args.layers, args.steps, [float(x) for x in args.lrs.split(",")], args.device)
        _print_trajectory(traj)
        _emit(args, "trajectory", traj)
        densities = [statistics.median(s["changed_fraction"] for s in run["per_step"]) for run in traj["runs"]]
        sizes = [int(x) for x in (args.codec_mib or ("64" if args.device == "cpu" else "256,2048")).split(",")]
        if args.device == "cpu":
            codec = codec_speed(sizes[0] << 20, max(s["changed_fraction"] for s in traj["runs"][0]["per_step"]))
            print(f"\ncodec on the CPU: {codec}")
            _emit(args, "codec", codec)
        else:
            rows = [codec_gpu(mib << 20, d) for mib in sizes for d in densities]
            _print_codec_table(rows)
            _emit(args, "codec_cuda", rows)
    if args.skip_refit or args.codec_only:
        return
    case = refit_case(args.refit_hidden, args.refit_layers, args.refit_experts)
    streams = None if args.synthetic else trajectory_streams(args.hidden, args.layers, args.steps, args.refit_lr,
                                                             args.device)
    res = refit(case, args.steps, densities[0], streams, backend)
    _print_refit_table(res)
    _emit(args, "refit", res)
    if res["problems"]:
        raise SystemExit(f"{len(res['problems'])} destination buffers differ from their version")


if __name__ == "__main__":
    main()
