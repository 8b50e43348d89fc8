"""Where the fused delta encode's time goes on a GPU (issue 35: encode >= 0.5 of a copy).

Per size and density (int16 runs, uniformly spread changes, as ``bench_delta.py``'s codec
table): a plain copy, ``delta_triton.encode_changes`` as the codec calls it, and its parts
timed apart with CUDA events for several block sizes and warp counts, each result checked
against the torch reference. Two forms: "bits" (the compare-and-flag pass, the scan of the
block counts, the compaction by 32-bit words or by elements, which reads the changed
elements again) and "staged" (the compare compacts each block's changes into slots of its
own while they are in registers; a second pass moves the slots to their places). The sum of
a form's parts against its whole is what the host read of the output's size costs (the
launches after it wait for the host).

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
    # The staged form: compare and compact within the block in one pass, then move the slots.
    cap = block // 8
    local = torch.empty(blocks * cap, dtype=torch.int16, device=cur.device)
    staged = torch.empty(blocks * cap, dtype=cur.dtype, device=cur.device)

    def stage():
        mod.stage_kernel[(blocks,)](cur, base, bits, counts, local, staged, n, BLOCK=block, CAP=cap, WIDE=wide,
                                    VALUES=True, num_warps=warps)

    out["stage_s"] = _seconds(stage, repeat)
    starts = torch.cumsum(counts, 0, dtype=torch.int64) - counts
    index.fill_(-1)
    out["gather_s"] = _seconds(lambda: mod.gather_staged_kernel[(blocks,)](
        cur, bits, counts, starts, local, staged, index, values, BLOCK=block, CAP=cap, WIDE=wide, VALUES=True,
        num_warps=warps), repeat)
    out["exact"] = out["exact"] and bool(torch.equal(index, ref) and torch.equal(values, cur[ref]))
    out["staged_parts_s"] = out["stage_s"] + out["scan_s"] + out["gather_s"]
    return out


def _whole(cur: torch.Tensor, base: torch.Tensor, repeat: int) -> dict:
    """Seconds of ``encode_changes`` as the codec calls it, in each form."""
    from elastic_refit.kernels import delta_triton

    out = {}
    for form in ("staged", "bits"):
        previous, delta_triton._form = delta_triton._form, form
        try:
            out[f"{form}_encode_s"] = _seconds(lambda: delta_triton.encode_changes(cur, base), repeat)
        finally:
            delta_triton._form = previous
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
    print("| MiB | changed | copy ms | staged encode ms (of copy) | bits encode ms (of copy) | block | warps | flag ms "
          "| scan ms | sparse compact ms | dense compact ms | stage ms | gather ms | bits parts of copy | staged parts "
          "of copy | exact |")
    print("|---" * 15 + "|")
    for mib in args.mib:
        n = (mib << 20) // 2
        g = torch.Generator(device="cuda").manual_seed(3)
        base = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, device="cuda", generator=g)
        target = torch.empty_like(base)
        for density in args.densities:
            cur = base.clone()
            cur[torch.rand(n, device="cuda", generator=g) < density] += 1
            whole = _whole(cur, base, args.repeat)
            # After the encode: a copy timed first in a process runs before the clocks ramp.
            copy_s = _seconds(lambda t=target, b=base: t.copy_(b), args.repeat)
            for block in args.blocks:
                for warps in args.warps:
                    if block // (32 * warps) < 1:
                        continue
                    r = parts(mod, cur, base, block, warps, args.repeat)
                    row = {"mib": mib, "density": density, "copy_s": copy_s, **whole, "block": block,
                           "warps": warps, **r}
                    rows.append(row)
                    ms = {k: f"{v * 1e3:.3f}" for k, v in row.items() if k.endswith("_s")}
                    print(f"| {mib} | {density:.1%} | {ms['copy_s']} | {ms['staged_encode_s']} "
                          f"({copy_s / whole['staged_encode_s']:.2f}) | {ms['bits_encode_s']} "
                          f"({copy_s / whole['bits_encode_s']:.2f}) | {block} | {warps} | {ms['flag_s']} | "
                          f"{ms['scan_s']} | {ms['sparse_s']} | {ms['dense_s']} | {ms['stage_s']} | {ms['gather_s']} | "
                          f"{copy_s / r['parts_s']:.2f} | {copy_s / r['staged_parts_s']:.2f} | {r['exact']} |",
                          flush=True)
            cur = None
        base = target = None
        torch.cuda.empty_cache()
    if args.json:
        print(json.dumps(rows))
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
