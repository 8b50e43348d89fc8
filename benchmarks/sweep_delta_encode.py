"""Where the fused delta encode's time goes on a GPU (issue 35: encode >= 0.5 of a copy).

Per size and density (int16 runs, uniformly spread changes, as ``bench_delta.py``'s codec
table): a plain copy, ``delta_triton.encode_changes`` as the codec calls it, and its parts
timed apart with CUDA events (the compare-and-flag pass, the scan of the block counts, the
compaction by 32-bit words and by elements) for several block sizes and warp counts, each
result checked against the torch reference. The sum of the parts (the faster compaction)
against the whole is what the host read of the output's size costs (the launches after it
wait for the host).

Run: ``python benchmarks/sweep_delta_encode.py [--mib 256 2048] [--densities 0.015 0.03 0.095] [--json]``
(CUDA and Triton needed).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from bench_delta import _cuda_seconds as _seconds  # CUDA events around each call, median


def parts(mod, cur: torch.Tensor, base: torch.Tensor, block: int, warps: int, repeat: int) -> dict:
    """Seconds of each pass of the encode at one block size and warp count; bit-exactness."""
    n = cur.numel()
    blocks = -(-n // block)
    wide = blocks * block >= 2**31
    bits = torch.empty(blocks * (block // 8), dtype=torch.uint8, device=cur.device)
    counts = torch.empty(blocks, dtype=torch.int32, device=cur.device)

    def flag():
        mod.flag_kernel[(blocks,)](cur, base, bits, counts, n, BLOCK=block, WIDE=wide, num_warps=warps)

    out = {"flag_s": _seconds(flag, repeat)}
    ends = torch.cumsum(counts, 0, dtype=torch.int64)
    out["scan_s"] = _seconds(lambda: torch.cumsum(counts, 0, dtype=torch.int64), repeat)
    k = int(ends[-1])
    starts = ends - counts
    index = torch.empty(k, dtype=torch.int64, device=cur.device)
    values = torch.empty(k, dtype=cur.dtype, device=cur.device)

    words = bits.view(torch.int32)
    sparse_warps = max(1, block // 1024)  # a lane per 32-element word of bits, as encode_changes launches it
    ref = (cur != base).nonzero().flatten()
    out["exact"] = True
    for name, run in (
            ("sparse", lambda: mod.compact_sparse_kernel[(blocks,)](cur, words, starts, index, values, BLOCK=block,
                                                                    WIDE=wide, VALUES=True, num_warps=sparse_warps)),
            ("dense", lambda: mod.compact_dense_kernel[(blocks,)](cur, bits, starts, index, values, BLOCK=block,
                                                                  WIDE=wide, VALUES=True, num_warps=warps))):
        index.fill_(-1)
        out[f"{name}_s"] = _seconds(run, repeat)
        out["exact"] = out["exact"] and bool(torch.equal(index, ref) and torch.equal(values, cur[ref]))
    out["parts_s"] = out["flag_s"] + out["scan_s"] + min(out["sparse_s"], out["dense_s"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, nargs="+", default=[256, 2048])
    p.add_argument("--densities", type=float, nargs="+", default=[0.015, 0.03, 0.095])
    p.add_argument("--blocks", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    from elastic_refit.kernels import delta_triton

    mod = delta_triton._module(torch.empty(1, device="cuda"))
    rows = []
    print("| MiB | changed | copy ms | encode ms (of copy) | block | warps | flag ms | scan ms | sparse compact ms | "
          "dense compact ms | parts of copy | exact |")
    print("|---" * 12 + "|")
    for mib in args.mib:
        n = (mib << 20) // 2
        g = torch.Generator(device="cuda").manual_seed(3)
        base = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, device="cuda", generator=g)
        target = torch.empty_like(base)
        for density in args.densities:
            cur = base.clone()
            cur[torch.rand(n, device="cuda", generator=g) < density] += 1
            encode_s = _seconds(lambda c=cur, b=base: delta_triton.encode_changes(c, b), args.repeat)
            # After the encode: a copy timed first in a process runs before the clocks ramp.
            copy_s = _seconds(lambda t=target, b=base: t.copy_(b), args.repeat)
            for block in args.blocks:
                for warps in args.warps:
                    if block // (32 * warps) < 1:
                        continue
                    r = parts(mod, cur, base, block, warps, args.repeat)
                    row = {"mib": mib, "density": density, "copy_s": copy_s, "encode_s": encode_s,
                           "block": block, "warps": warps, **r}
                    rows.append(row)
                    print(f"| {mib} | {density:.1%} | {copy_s * 1e3:.3f} | {encode_s * 1e3:.3f} "
                          f"({copy_s / encode_s:.2f}) | {block} | {warps} | {r['flag_s'] * 1e3:.3f} | "
                          f"{r['scan_s'] * 1e3:.3f} | {r['sparse_s'] * 1e3:.3f} | {r['dense_s'] * 1e3:.3f} | "
                          f"{copy_s / r['parts_s']:.2f} | {r['exact']} |", flush=True)
            cur = None
        base = target = None
        torch.cuda.empty_cache()
    if args.json:
        print(json.dumps(rows))
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
