"""Benchmark the pack/unpack kernels against a plain device-to-device copy of the same bytes.

Cases (realistic refit boxes):
  (a) TP re-slicing of stacked expert weights [E, I, H] bf16: boxes [E, I/tp, H], all tp parts
  (b) column slices [:, c0:c1] of a row-major [8192, 8192] bf16 matrix: every block of width w,
      and one single slice
  (c) hundreds of small norm vectors ([4096] / [7168], bf16 / fp32) packed whole into one bucket

GB/s counts payload bytes once (each is read once and written once, so memory traffic is
twice that), the same for the copy baseline, which is ``dst.copy_(src)`` of as many bytes.
Timing: CUDA events around N back-to-back calls after warm-up, median of several repeats;
inputs rotate among enough buffer sets to exceed the L2 cache. "eager" is the bound Python
call (``PackProgram.bind(...).pack()``: one Triton launch), "graph" replays the same calls
captured in a CUDA graph (pure GPU time, no launch overhead). ``ref`` is the torch reference
(one slice copy per region), eager.

Goal (issue 39): eager pack and unpack of every row at >= 0.8 of the copy (``GOAL``), bit-exact;
the last lines say whether it is met.

Usage: PYTHONPATH=. python benchmarks/bench_kernels.py [--device cuda] [--json] [--sweep] [--small]
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

import torch
from elastic_refit.kernels import BoxRegion, PackProgram

L2_BYTES = 60 << 20
GOAL = 0.8  # eager pack / unpack over an eager copy of the same bytes, every row


@dataclass
class Case:
    name: str
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]
    regions: list[BoxRegion]


def _itemsize(dt: torch.dtype) -> int:
    return torch.empty((), dtype=dt).element_size()


def expert_case(e: int, i: int, h: int, tp: int) -> Case:
    step = i // tp
    nb = e * step * h * 2
    regions = [BoxRegion(0, (0, k * step, 0), (e, step, h), k * nb) for k in range(tp)]
    return Case(f"a experts [{e},{i},{h}] tp={tp}", [(e, i, h)], [torch.bfloat16], regions)


def column_case(n: int, width: int, single: bool) -> Case:
    starts = [width] if single else list(range(0, n - width + 1, width))
    nb = n * width * 2
    regions = [BoxRegion(0, (0, c), (n, width), k * nb) for k, c in enumerate(starts)]
    what = f"cols [{width}:{2 * width}]" if single else f"all col blocks w={width}"
    return Case(f"b [{n},{n}] {what}", [(n, n)], [torch.bfloat16], regions)


def vectors_case(groups: list[tuple[int, int, torch.dtype]]) -> Case:
    shapes, dtypes, regions, cur = [], [], [], 0
    for count, length, dt in groups:
        for _ in range(count):
            regions.append(BoxRegion(len(shapes), (0,), (length,), cur))
            shapes.append((length,))
            dtypes.append(dt)
            cur += length * _itemsize(dt)
    desc = " + ".join(f"{c}x[{n}] {str(dt).removeprefix('torch.')}" for c, n, dt in groups)
    return Case(f"c {desc}", shapes, dtypes, regions)


def all_cases(small: bool) -> list[Case]:
    if small:  # a few MiB: a smoke run of this script on CPU
        return [
            expert_case(4, 64, 128, 4),
            column_case(256, 64, single=False),
            column_case(256, 64, single=True),
            vectors_case([(16, 256, torch.bfloat16), (16, 448, torch.float32)]),
        ]
    return [
        expert_case(64, 2048, 4096, 2),
        expert_case(64, 2048, 4096, 4),
        expert_case(64, 2048, 4096, 8),
        column_case(8192, 1024, single=False),
        column_case(8192, 2048, single=False),
        column_case(8192, 4096, single=False),
        column_case(8192, 1024, single=True),
        column_case(8192, 4096, single=True),
        vectors_case([(256, 4096, torch.bfloat16)]),
        vectors_case([(512, 4096, torch.bfloat16)]),
        vectors_case([(256, 7168, torch.bfloat16), (256, 7168, torch.float32)]),
    ]


class Timer:
    """Per-call seconds of ``fn`` over rotating inputs: median of repeats of N calls."""

    def __init__(self, device: torch.device, repeats: int, target_s: float):
        self.device = device
        self.repeats = repeats
        self.target_s = target_s

    def _elapsed(self, fn: Callable[[int], None], n: int, start: int) -> float:
        if self.device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for k in range(n):
                fn(start + k)
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        t0 = time.perf_counter()
        for k in range(n):
            fn(start + k)
        return time.perf_counter() - t0

    def eager(self, fn: Callable[[int], None], k_sets: int) -> float:
        for k in range(max(3, k_sets)):  # touch every rotating set once before timing
            fn(k)
        one = self._elapsed(fn, 1, 0)
        n = max(3, min(500, math.ceil(self.target_s / max(one, 1e-7))))
        return statistics.median(self._elapsed(fn, n, r * n) / n for r in range(self.repeats))

    def graph(self, fn: Callable[[int], None], k_sets: int) -> float | None:
        """Replay a graph of ``n`` captured calls (rotating sets); None if capture fails."""
        if self.device.type != "cuda":
            return None
        one = self.eager_once(fn)
        n = max(k_sets, min(2000, math.ceil(self.target_s / max(one, 1e-7))))
        n = -(-n // k_sets) * k_sets
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for k in range(k_sets):
                    fn(k)
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for k in range(n):
                    fn(k)
        except Exception as exc:  # capture unsupported: report it, keep the eager numbers
            print(f"  graph capture failed: {exc}", file=sys.stderr)
            return None
        g.replay()
        torch.cuda.synchronize()

        def replay(_: int) -> None:
            g.replay()

        return statistics.median(self._elapsed(replay, 1, 0) for _ in range(self.repeats)) / n

    def eager_once(self, fn: Callable[[int], None]) -> float:
        fn(0)
        return self._elapsed(fn, 1, 0)


def _programs(
    case: Case, device: torch.device, tile: int, warps: int, backend: str
) -> tuple[PackProgram, PackProgram]:
    """The program under test and the torch reference over the same regions."""
    prog = PackProgram(
        case.shapes,
        case.dtypes,
        case.regions,
        device=device,
        backend=backend,
        tile_bytes=tile,
        num_warps=warps,
    )
    ref = PackProgram(case.shapes, case.dtypes, case.regions, device=device, backend="torch")
    return prog, ref


def _num_sets(case: Case, nbytes: int) -> int:
    """How many buffer sets to rotate among so that they exceed the L2 cache (1 to 64)."""
    tensor_bytes = sum(
        math.prod(s) * _itemsize(d) for s, d in zip(case.shapes, case.dtypes, strict=True)
    )
    footprint = tensor_bytes + nbytes
    return max(1, min(64, math.ceil(4 * L2_BYTES / footprint)))


def _random_tensors(case: Case, device: torch.device, gen: torch.Generator) -> list[torch.Tensor]:
    """The case's tensors, filled with random bytes from ``gen``."""
    return [
        torch.randint(
            0,
            256,
            (math.prod(s) * _itemsize(d),),
            dtype=torch.uint8,
            device=device,
            generator=gen,
        )
        .view(d)
        .reshape(s)
        for s, d in zip(case.shapes, case.dtypes, strict=True)
    ]


def _buffer_sets(
    case: Case, device: torch.device, nbytes: int, k_sets: int
) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """``k_sets`` of (random tensors, packed buffer), from a generator seeded with 0."""
    gen = torch.Generator(device=device).manual_seed(0)
    return [
        (_random_tensors(case, device, gen), torch.empty(nbytes, dtype=torch.uint8, device=device))
        for _ in range(k_sets)
    ]


def _bit_exact(bound, ref: PackProgram, tensors: list[torch.Tensor], packed: torch.Tensor) -> bool:
    """Pack one set through ``bound`` and the reference: bit-exact? (in the same run as the timings)"""
    check = torch.empty_like(packed)
    bound.pack()
    ref.pack(tensors, check)
    return bool(torch.equal(check, packed))


def _copy_pairs(
    nbytes: int, device: torch.device, k_sets: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``k_sets`` of (destination, source) byte buffers for the copy baseline."""
    return [
        (
            torch.empty(nbytes, dtype=torch.uint8, device=device),
            torch.empty(nbytes, dtype=torch.uint8, device=device),
        )
        for _ in range(k_sets)
    ]


def _timed_calls(prog, ref, sets, binds, gbinds, copies) -> dict[str, Callable[[int], None]]:
    """Every call to time, by the name of its figure; call ``k`` uses set ``k % k_sets``.
    The cuda_graph-bound calls are there only when ``gbinds`` is (CUDA)."""
    k_sets = len(sets)

    def copy(k):
        d, s = copies[k % k_sets]
        d.copy_(s)

    def pack(k):
        binds[k % k_sets].pack()

    def unpack(k):
        binds[k % k_sets].unpack()

    def gpack(k):
        gbinds[k % k_sets].pack()

    def gunpack(k):
        gbinds[k % k_sets].unpack()

    def pack_unbound(k):
        t, b = sets[k % k_sets]
        prog.pack(t, b)

    def ref_pack(k):
        t, b = sets[k % k_sets]
        ref.pack(t, b)

    def ref_unpack(k):
        t, b = sets[k % k_sets]
        ref.unpack(b, t)

    calls = {"copy": copy, "pack": pack, "unpack": unpack, "pack_unbound": pack_unbound,
             "ref_pack": ref_pack, "ref_unpack": ref_unpack}  # fmt: skip
    if gbinds:
        calls.update(gbind_pack=gpack, gbind_unpack=gunpack)
    return calls


def _time_calls(
    timer: Timer, calls: dict[str, Callable[[int], None]], k_sets: int, with_ref: bool
) -> dict[str, float | None]:
    """Seconds per call of each figure, ``<name>_s``, in the order of the JSON rows."""
    res: dict[str, float | None] = {}
    for name in ("copy", "pack", "unpack", "pack_unbound"):
        res[f"{name}_s"] = timer.eager(calls[name], k_sets)
    for name in ("gbind_pack", "gbind_unpack"):
        res[f"{name}_s"] = timer.eager(calls[name], k_sets) if name in calls else None
    if with_ref:
        res["ref_pack_s"] = timer.eager(calls["ref_pack"], k_sets)
        res["ref_unpack_s"] = timer.eager(calls["ref_unpack"], k_sets)
    for name in ("copy", "pack", "unpack"):
        res[f"graph_{name}_s"] = timer.graph(calls[name], k_sets)
    return res


def bench_case(
    case: Case,
    device: torch.device,
    timer: Timer,
    tile: int,
    warps: int,
    backend: str,
    with_ref: bool,
) -> dict:
    """One row: the case's pack/unpack timings against a copy of as many bytes, and bit-exactness."""
    prog, ref = _programs(case, device, tile, warps, backend)
    nbytes = prog.nbytes
    k_sets = _num_sets(case, nbytes)
    sets = _buffer_sets(case, device, nbytes, k_sets)
    binds = [prog.bind(t, b) for t, b in sets]
    gbinds = [prog.bind(t, b, cuda_graph=True) for t, b in sets] if device.type == "cuda" else []
    # Correctness in the same run: Triton vs reference, bit-exact, on the first set.
    ok = _bit_exact(binds[0], ref, *sets[0])
    copies = _copy_pairs(nbytes, device, k_sets)
    res = {
        "case": case.name,
        "bytes": nbytes,
        "regions": len(case.regions),
        "programs": prog.num_launch_programs,
        "k_sets": k_sets,
        "tile_bytes": tile,
        "num_warps": warps,
        "bit_exact": ok,
    }
    calls = _timed_calls(prog, ref, sets, binds, gbinds, copies)
    res.update(_time_calls(timer, calls, k_sets, with_ref))
    return res


def goal_summary(rows: list[dict]) -> dict:
    """Whether every row's eager pack and unpack reach ``GOAL`` of the copy, and the worst."""
    if not rows:
        return {"met": False, "min_pack": 0.0, "min_unpack": 0.0, "worst_pack": "", "worst_unpack": "",
                "bit_exact": False}
    pack = min(rows, key=lambda r: r["copy_s"] / r["pack_s"])
    unpack = min(rows, key=lambda r: r["copy_s"] / r["unpack_s"])
    lo_p, lo_u = pack["copy_s"] / pack["pack_s"], unpack["copy_s"] / unpack["unpack_s"]
    exact = all(r["bit_exact"] for r in rows)
    return {"met": lo_p >= GOAL and lo_u >= GOAL and exact, "min_pack": lo_p, "min_unpack": lo_u,
            "worst_pack": pack["case"], "worst_unpack": unpack["case"], "bit_exact": exact}


def gbps(nbytes: int, s: float | None) -> str:
    return "-" if not s else f"{nbytes / s / 1e9:8.1f}"


def ratio(num: float | None, den: float | None) -> str:
    return "-" if not num or not den else f"{num / den:5.2f}"


def print_table(rows: list[dict]) -> None:
    head = ("case", "MiB", "copy", "pack", "p/c", "unpack", "u/c", "bg p/c", "bg u/c",
            "pack-nb", "ref pk", "ref up", "g copy", "g pack", "g p/c", "g unpk", "g u/c",
            "exact")  # fmt: skip
    print("GB/s of payload (bytes packed); x/c = copy time / kernel time, eager;")
    print("pack/unpack = bound calls (bind().pack()); bg = bound with cuda_graph=True (replays a")
    print("captured launch), vs eager copy; pack-nb = unbound pack(tensors, out) with per-call")
    print("checks; ref = torch reference; g = N calls captured in one CUDA graph (GPU time only)")
    print()
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        n = r["bytes"]
        cells = (
            r["case"], f"{n / 2**20:.1f}", gbps(n, r["copy_s"]), gbps(n, r["pack_s"]),
            ratio(r["copy_s"], r["pack_s"]), gbps(n, r["unpack_s"]),
            ratio(r["copy_s"], r["unpack_s"]), ratio(r["copy_s"], r["gbind_pack_s"]),
            ratio(r["copy_s"], r["gbind_unpack_s"]), gbps(n, r["pack_unbound_s"]),
            gbps(n, r.get("ref_pack_s")), gbps(n, r.get("ref_unpack_s")),
            gbps(n, r["graph_copy_s"]), gbps(n, r["graph_pack_s"]),
            ratio(r["graph_copy_s"], r["graph_pack_s"]), gbps(n, r["graph_unpack_s"]),
            ratio(r["graph_copy_s"], r["graph_unpack_s"]), str(r["bit_exact"]),
        )  # fmt: skip
        print("| " + " | ".join(c.strip() for c in cells) + " |")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    ap.add_argument("--json-out", default="", help="also write the JSON object to this file")
    ap.add_argument("--small", action="store_true", help="tiny sizes (smoke run, works on CPU)")
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="also time other (tile_bytes, num_warps) on a few cases",
    )
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="where to run (auto: cuda when there is a GPU); cpu needs --small")
    ap.add_argument("--tile-bytes", type=int, default=8192)
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--only", default="", help="substring filter on case names")
    return ap.parse_args(argv)


def _pick_device(args: argparse.Namespace) -> torch.device | None:
    """The device to run on, or None (after saying why on stderr) when it can't run here."""
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return None
    want = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(want)
    if device.type != "cuda" and not args.small:
        print("no CUDA device: run with --small for a CPU smoke run", file=sys.stderr)
        return None
    return device


def _bench_rows(
    cases: list[Case], device: torch.device, timer: Timer, args: argparse.Namespace, backend: str
) -> list[dict]:
    """One row per case at the chosen tile and warps, with the reference; progress on stderr."""
    rows = []
    for case in cases:
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the previous case's buffers are garbage by now
        t0 = time.perf_counter()
        rows.append(
            bench_case(case, device, timer, args.tile_bytes, args.num_warps, backend, with_ref=True)
        )
        if not args.json:
            print(f"  {case.name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return rows


def _bench_sweep(cases: list[Case], device: torch.device, timer: Timer, backend: str) -> list[dict]:
    """Rows of a few cases at other (tile_bytes, num_warps), without the reference."""
    sweep = []
    configs = [(4096, 4), (16384, 4), (8192, 8)]
    picks = [c for c in cases if any(k in c.name for k in ("tp=4", "w=1024", "512x"))]
    for tile, warps in configs:
        for case in picks:
            sweep.append(bench_case(case, device, timer, tile, warps, backend, with_ref=False))
    return sweep


def _print_goal(g: dict) -> None:
    print(f"\neager pack / unpack >= {GOAL} of a copy on every row: {'yes' if g['met'] else 'NO'} "
          f"(lowest p/c {g['min_pack']:.2f} in {g['worst_pack']!r}, u/c {g['min_unpack']:.2f} in "
          f"{g['worst_unpack']!r}); bit-exact: {g['bit_exact']}")


def _print_sweep(sweep: list[dict]) -> None:
    print("\nsweep (tile_bytes, num_warps):\n")
    print("| case | tile | warps | pack GB/s | p/c | unpack GB/s | u/c | g p/c | g u/c |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in sweep:
        n = r["bytes"]
        print(
            f"| {r['case']} | {r['tile_bytes']} | {r['num_warps']} | "
            f"{gbps(n, r['pack_s']).strip()} | {ratio(r['copy_s'], r['pack_s'])} | "
            f"{gbps(n, r['unpack_s']).strip()} | {ratio(r['copy_s'], r['unpack_s'])} | "
            f"{ratio(r['graph_copy_s'], r['graph_pack_s'])} | "
            f"{ratio(r['graph_copy_s'], r['graph_unpack_s'])} |"
        )


def _print_report(doc: dict, args: argparse.Namespace) -> None:
    """The tables and the goal's verdict line (what is printed without --json)."""
    print(f"\n{doc['meta']}; tile_bytes={args.tile_bytes} num_warps={args.num_warps}\n")
    print_table(doc["rows"])
    _print_goal(doc["goal"])
    if doc["sweep"]:
        _print_sweep(doc["sweep"])


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    device = _pick_device(args)
    if device is None:
        return 2
    backend = "triton"
    timer = Timer(device, args.repeats, target_s=0.005 if device.type == "cuda" else 0.0)
    cases = [c for c in all_cases(args.small) if args.only in c.name]
    meta = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
    }
    rows = _bench_rows(cases, device, timer, args, backend)
    sweep = _bench_sweep(cases, device, timer, backend) if args.sweep else []
    from elastic_refit.kernels import _triton_backend

    meta["launches"] = _triton_backend.direct_stats()
    doc = {"meta": meta, "args": vars(args), "rows": rows, "sweep": sweep, "goal": goal_summary(rows)}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(doc, f, indent=1)
    if args.json:
        print(json.dumps(doc))
    else:
        _print_report(doc, args)
    return 0 if all(r["bit_exact"] for r in rows + sweep) else 1


if __name__ == "__main__":
    sys.exit(main())
