"""Fused pack + quantize (BF16 -> FP8 + scales) against a plain copy of the same BF16 bytes.

Cases (DeepSeek-V3 refit boxes; ``--small`` scales them down for a CPU smoke run):
  (a) experts: whole experts of ``mlp.experts.{gate,up}_proj`` [E, 2048, 7168], one box each
  (b) TP=8 column slices of ``o_proj`` [7168, 16384]: eight boxes [7168, 2048]
  (c) attention projections of 8 layers: kv_a_proj_with_mqa [576, 7168] (a partial edge
      block), q_a_proj [1536, 7168], q_b_proj [3072, 1536], kv_b_proj [4096, 512]

Rows, per case: ``copy`` is ``dst.copy_(src)`` of the boxes' BF16 bytes (one contiguous
device copy), ``pack`` the box-copy kernel (``PackProgram``) packing the same boxes as BF16,
``fp8-block128`` / ``mxfp8`` the fused ``QuantPackProgram`` (``soft`` = integer E4M3 cast),
each at its best ``--warps`` x ``chunk_rows`` (rows per pass of a 128-row block: 32, 64, or
128 = one pass). GB/s counts the BF16 input bytes once for every row, so
``vs copy`` (quantize GB/s / copy GB/s) is the fraction of copy speed kept while writing FP8
(goal >= 0.70 on an H200). Timing: CUDA events around N back-to-back calls after warm-up,
median of repeats, inputs rotating among enough sets to exceed L2 (CPU: perf_counter).
``verified`` compares the fused bucket with the reference quantizer (torch ops, on the CPU)
byte for byte, for buckets up to ``--verify-mib``.

Usage: python benchmarks/bench_quantize.py [--device cuda|cpu] [--small] [--json] [--json-out F]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, too

from elastic_refit.kernels import BoxRegion, PackProgram
from elastic_refit.kernels.quant_program import QuantPackProgram, QuantRegion

from elastic_refit.layout.formats import FP8_BLOCK128, MXFP8

L2_BYTES = 60 << 20


@dataclass
class Case:
    name: str
    shapes: list[tuple[int, ...]]
    boxes: list[tuple[int, tuple[int, ...], tuple[int, ...]]]  # (tensor, offsets, lengths)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(n) * 2 for _, _, n in self.boxes)


def cases(small: bool) -> list[Case]:
    k = 8 if small else 1  # --small divides the big dims by 8 (blocks stay 128 x 128)
    e, i, h = (2, 256, 896) if small else (8, 2048, 7168)
    experts = Case(f"a experts 2x[{e},{i},{h}]", [(e, i, h), (e, i, h)],
                   [(0, (0, 0, 0), (e, i, h)), (1, (0, 0, 0), (e, i, h))])
    rows, cols, tp = 7168 // k, 16384 // k, 8
    step = cols // tp
    o_proj = Case(f"b o_proj [{rows},{cols}] tp={tp}", [(rows, cols)],
                  [(0, (0, c * step), (rows, step)) for c in range(tp)])
    attn_shapes = [(576, 7168 // k), (1536, 7168 // k), (3072, 1536), (4096 // k, 512)]
    layers = 2 if small else 8
    shapes = attn_shapes * layers
    attn = Case(f"c attention x{layers} layers", shapes, [(t, (0, 0), s) for t, s in enumerate(shapes)])
    return [experts, o_proj, attn]


def layout(case: Case, fmt) -> tuple[list[QuantRegion], list[BoxRegion]]:
    """Quantized regions (data then scales, 16-byte aligned) and the BF16 pack regions."""
    br, bc = fmt.block_shape
    isz = 4 if fmt.kind == "fp8-block" else 1
    quant, plain, at, at_plain = [], [], 0, 0
    for t, offs, lens in case.boxes:
        blocks = math.prod((*lens[:-2], -(-lens[-2] // br), -(-lens[-1] // bc)))
        quant.append(QuantRegion(t, offs, lens, at, at + math.prod(lens)))
        at += math.prod(lens) + blocks * isz
        at += (-at) % 16
        plain.append(BoxRegion(t, offs, lens, at_plain))
        at_plain += math.prod(lens) * 2
    return quant, plain


class Timer:
    def __init__(self, device: torch.device, repeats: int, target_s: float):
        self.device, self.repeats, self.target_s = device, repeats, target_s

    def _elapsed(self, fn: Callable[[int], None], n: int) -> float:
        if self.device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for j in range(n):
                fn(j)
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        t0 = time.perf_counter()
        for j in range(n):
            fn(j)
        return time.perf_counter() - t0

    def per_call(self, fn: Callable[[int], None], num_sets: int) -> float:
        for j in range(max(2, num_sets)):  # warm-up: compile, touch every set
            fn(j)
        one = self._elapsed(fn, 1)
        n = max(2, min(200, math.ceil(self.target_s / max(one, 1e-7))))
        return statistics.median(self._elapsed(fn, n) / n for _ in range(self.repeats))


def bench_case(case: Case, device: torch.device, timer: Timer, warps: list[int], chunks: list[int],
               soft: bool, verify_mib: float, backend: str) -> list[dict]:
    num_sets = max(1, min(8, math.ceil(2 * L2_BYTES / case.nbytes))) if device.type == "cuda" else 1
    gen = torch.Generator().manual_seed(0)
    sets = [[(torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16).to(device) for s in case.shapes]
            for _ in range(num_sets)]
    rows: list[dict] = []

    def row(what: str, seconds: float, extra: dict | None = None) -> dict:
        r = {"case": case.name, "kernel": what, "bf16_bytes": case.nbytes, "seconds": seconds,
             "gbps": case.nbytes / seconds / 1e9, **(extra or {})}
        rows.append(r)
        return r

    # Plain copy of the same BF16 bytes, contiguous.
    src = [torch.empty(case.nbytes, dtype=torch.uint8, device=device) for _ in sets]
    dst = [torch.empty_like(s) for s in src]
    copy = row("copy", timer.per_call(lambda j: dst[j % len(dst)].copy_(src[j % len(src)]), len(src)))
    _, plain = layout(case, FP8_BLOCK128)
    pack = PackProgram(case.shapes, [torch.bfloat16] * len(case.shapes), plain, device=device, backend=backend)
    pbuf = [torch.empty(pack.nbytes, dtype=torch.uint8, device=device) for _ in sets]
    binds = [pack.bind(ts, b) for ts, b in zip(sets, pbuf, strict=True)]
    row("pack bf16", timer.per_call(lambda j: binds[j % len(binds)].pack(), len(binds)))
    variants = [(FP8_BLOCK128, False), (MXFP8, False)] + ([(FP8_BLOCK128, True)] if soft else [])
    for fmt, soft_cast in variants:
        regions, _ = layout(case, fmt)
        best = None
        rows_per_pass = chunks if fmt.kind == "fp8-block" else [None]
        configs = [(w, c) for w in warps for c in rows_per_pass] if backend == "triton" else [(8, None)]
        for w, c in configs:
            # soft_cast None: the hardware E4M3 cast on CUDA (the interpreter's is inexact).
            prog = QuantPackProgram(case.shapes, regions, fmt, device=device, backend=backend,
                                    soft_cast=True if soft_cast else None, num_warps=w, chunk_rows=c)
            qbuf = [torch.empty(prog.nbytes, dtype=torch.uint8, device=device) for _ in sets]
            s = timer.per_call(lambda j, p=prog, q=qbuf: p.pack(sets[j % len(sets)], q[j % len(q)]), len(qbuf))
            if best is None or s < best[0]:
                best = (s, w, c, prog, qbuf)
            del qbuf
        s, w, c, prog, _ = best
        name = f"{fmt.name}{' soft' if soft_cast else ''}"
        verified: bool | None = None
        if case.nbytes <= verify_mib * 2**20:
            # Against the reference quantizer on the CPU (torch ops per box), as tests/gpu
            # checks: the definition of the bytes, whatever device quantized them.
            ref = QuantPackProgram(case.shapes, regions, fmt, device=torch.device("cpu"), backend="torch")
            want = torch.zeros(prog.nbytes, dtype=torch.uint8)
            ref.pack([t.cpu() for t in sets[0]], want)
            got = torch.zeros(prog.nbytes, dtype=torch.uint8, device=device)
            prog.pack(sets[0], got)
            verified = bool(torch.equal(got.cpu(), want))
            del want, got
        row(name, s, {"warps": w if backend == "triton" else None, "chunk_rows": prog.tiles[2] if backend == "triton" else None,
                      "fp8_bucket_bytes": prog.nbytes, "vs_copy": copy["seconds"] / s, "verified": verified})
    for r in rows:
        r.setdefault("vs_copy", copy["seconds"] / r["seconds"])
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'case':34} {'kernel':18} {'MiB bf16':>9} {'GB/s':>8} {'vs copy':>8} {'warps':>5} {'chunk':>5} "
          f"{'verified':>8}")
    for r in rows:
        v = {True: "yes", False: "NO", None: "-"}[r.get("verified")]
        print(f"{r['case']:34} {r['kernel']:18} {r['bf16_bytes'] / 2**20:9.1f} {r['gbps']:8.3g} "
              f"{r['vs_copy']:8.3f} {r.get('warps') or '-':>5} {r.get('chunk_rows') or '-':>5} {v:>8}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="scaled-down cases (default on CPU)")
    ap.add_argument("--warps", default="4,8,16", help="num_warps to try for the fused kernel (best kept)")
    ap.add_argument("--chunks", default="32,64,128", help="rows per pass of a 128-row block to try")
    ap.add_argument("--no-soft", action="store_true", help="skip the software-cast variant")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--target-s", type=float, default=0.2, help="seconds per timed repeat")
    ap.add_argument("--verify-mib", type=float, default=1024.0, help="verify buckets up to this many MiB of bf16")
    ap.add_argument("--cases", default="abc", help="which cases to run (letters)")
    ap.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto",
                    help="auto: triton on CUDA, torch on CPU (triton on CPU: the interpreter, a dry run)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--json-out", default="", help="also write the JSON object to this file")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device is available")
    small = args.small or device.type == "cpu"
    timer = Timer(device, args.repeats if device.type == "cuda" else min(args.repeats, 3), args.target_s)
    warps = [int(w) for w in args.warps.split(",") if w]
    rows = []
    for case in (c for c in cases(small) if c.name[0] in args.cases):
        backend = args.backend if args.backend != "auto" else ("triton" if device.type == "cuda" else "torch")
        rows += bench_case(case, device, timer, warps, [int(c) for c in args.chunks.split(",") if c],
                           soft=backend == "triton" and not args.no_soft,
                           verify_mib=args.verify_mib, backend=backend)
        if not args.json:
            print(f"  done: {case.name}", file=sys.stderr, flush=True)
    quant = [r for r in rows if r["kernel"].startswith("fp8-block128") and "soft" not in r["kernel"]]
    doc = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "small": small,
        "rows": rows,
        "min_fp8_vs_copy": min(r["vs_copy"] for r in quant),
        "goal_vs_copy": 0.70,
        "all_verified": all(r.get("verified") is not False for r in rows),
    }
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=1))
    if args.json:
        print(json.dumps(doc))
    else:
        print_table(rows)
        print(f"fp8-block128 fused pack+quantize vs copy: min {doc['min_fp8_vs_copy']:.2f} (goal >= 0.70); "
              f"verified: {'all' if doc['all_verified'] else 'NOT ALL'}")
    return 0 if doc["all_verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
