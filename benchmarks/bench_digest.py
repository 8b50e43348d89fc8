"""What the runtime's source checks cost (a benchmark, not a test).

    .venv/bin/python benchmarks/bench_digest.py [--mib 256] [--repeat 5] [--device cpu|cuda]
                                                [--processes K] [--json]

``publish`` digests every source buffer (and each replica region it shares) before any
byte moves, and a source digests its buffers again after its sends. This times that
digest on one buffer of ``--mib`` MiB against a plain copy of the same bytes (the cheapest
thing a real snapshot could be) and against the earlier form of the digest (two
whole-buffer torch reductions, a zero-padded copy for unaligned data), side by side in one
process, median of ``--repeat``; ``unaligned`` rows digest the same bytes one byte in. On
a CPU the ``numpy`` rows time the numpy form of the same digest (row and column sums, the
fallback where the compiled form, ``_digest.c``, was not built) beside ``digest``, which
takes the compiled form when it was built (``compiled`` in the output says which).
``--processes K`` runs K such processes at once (as the ranks of a CPU bench share the
cores) and reports the aggregate rate of each operation.

``--boxes N`` (CUDA, Triton) times a bucket's checks instead: ``--mib`` MiB cut into N
boxes of mixed sizes, some off whole words, as a receiver checks them: box by box (a
digest and a comparison each, what ``BucketIO`` did before ``kernels.digests``) against
every box in one launch with one comparison (``BoxDigests``), beside a copy of the bytes;
both give the same digests (checked).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch

from elastic_refit.cli._output import render_table
from elastic_refit.transport import buffers
from elastic_refit.transport.buffers import buffer_digests, digest


def earlier_digest(data: torch.Tensor) -> torch.Tensor:
    """The digest before the single-read form (kept here only to compare against)."""
    n = data.numel()
    words = -(-n // 8)
    if words * 8 != n or data.storage_offset() % 8:
        padded = torch.zeros(words * 8, dtype=torch.uint8, device=data.device)
        padded[:n] = data
        data = padded
    w = data.view(torch.int64)
    rows = words // 1024
    main = w[: rows * 1024].view(rows, 1024)
    col = torch.arange(1024, dtype=torch.int64, device=w.device) * 2 + 1
    row = torch.arange(rows, dtype=torch.int64, device=w.device) * 0x9E3779B1 + 1
    h = (main.sum(dim=0) * col).sum() + (main.sum(dim=1) * row).sum()
    tail = w[rows * 1024:]
    if tail.numel():
        h = h + (tail * (torch.arange(tail.numel(), dtype=torch.int64, device=w.device) * 0x85EBCA77 + 7)).sum()
    return h ^ n


def _time(fn, device: torch.device, repeat: int) -> float:
    fn()  # warm-up (allocations, kernels)
    out = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


OPERATIONS = ("digest", "digest_unaligned", "numpy", "numpy_unaligned", "earlier_digest", "earlier_digest_unaligned",
              "copy")


def operations(device: str) -> tuple[str, ...]:
    return OPERATIONS if torch.device(device).type == "cpu" else tuple(o for o in OPERATIONS if "numpy" not in o)


def measure(mib: int, repeat: int, device_name: str) -> dict[str, float]:
    """Seconds of each operation on one buffer of ``mib`` MiB (median of ``repeat``)."""
    device = torch.device(device_name)
    nbytes = mib << 20
    raw = torch.randint(-2**31, 2**31 - 1, (nbytes // 4 + 2,), dtype=torch.int32, device=device).view(torch.uint8)
    buffer = raw[: nbytes].view(torch.bfloat16)
    unaligned = raw[1 : nbytes + 1]
    spare = torch.empty_like(buffer)
    fns = {"digest": lambda: buffer_digests({"w": buffer}),
           "digest_unaligned": lambda: int(digest(unaligned)),
           "numpy": lambda: buffers._digest_cpu(buffer.view(torch.uint8).numpy(), True),
           "numpy_unaligned": lambda: buffers._digest_cpu(unaligned.numpy(), False),
           "earlier_digest": lambda: int(earlier_digest(buffer.view(torch.uint8))),
           "earlier_digest_unaligned": lambda: int(earlier_digest(unaligned)),
           "copy": lambda: spare.copy_(buffer)}
    if device.type == "cpu":  # the forms agree (their tests say so too)
        assert buffers._digest_cpu(unaligned.numpy(), False) == int(digest(unaligned))
    return {name: _time(fns[name], device, repeat) for name in operations(device_name)}


def measure_bucket(mib: int, num_boxes: int, repeat: int, device_name: str) -> dict[str, float]:
    """Seconds to check a bucket of ``num_boxes`` boxes, box by box and in one launch."""
    from elastic_refit.kernels.digests import BoxDigests

    device = torch.device(device_name)
    gen = torch.Generator().manual_seed(num_boxes)
    weights = torch.rand(num_boxes, generator=gen) + 0.05
    sizes = (weights / weights.sum() * (mib << 20)).long().clamp(min=1)
    sizes[::3] += 3  # a third of the boxes end off a whole word, and the next ones start off one
    starts = torch.cumsum(sizes, 0) - sizes
    ranges = list(zip(starts.tolist(), sizes.tolist(), strict=True))
    data = torch.randint(0, 256, (int(sizes.sum()),), dtype=torch.uint8, device=device)
    fused = BoxDigests(ranges, device)
    want = fused(data)
    assert want.tolist() == [int(digest(data[o : o + n])) for o, n in ranges], "the two forms differ"
    spare = torch.empty_like(data)

    def per_box() -> None:
        for i, (o, n) in enumerate(ranges):
            if int(digest(data[o : o + n])) != int(want[i]):
                raise AssertionError(i)

    def one_launch() -> None:
        if bool((fused(data) != want).any()):
            raise AssertionError("mismatch")

    fns = {"per_box": per_box, "one_launch": one_launch, "copy": lambda: spare.copy_(data)}
    return {name: _time(fn, device, repeat) for name, fn in fns.items()}


def _bucket_main(args) -> int:
    seconds = measure_bucket(args.mib, args.boxes, args.repeat, args.device)
    out = {"device": args.device, "bytes": args.mib << 20, "boxes": args.boxes, "repeat": args.repeat,
           **{f"{name}_seconds": s for name, s in seconds.items()},
           "per_box_vs_one_launch": seconds["per_box"] / seconds["one_launch"]}
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    print(f"a bucket of {args.mib} MiB in {args.boxes} boxes on {args.device}, checked; median of {args.repeat}")
    labels = {"per_box": "box by box (digest, compare)", "one_launch": "one launch (BoxDigests), one compare",
              "copy": "plain copy"}
    print(render_table(("operation", "time", "vs copy"), [
        (labels[k], f"{s * 1e3:.3f} ms", f"{s / seconds['copy']:.2f}x") for k, s in seconds.items()]))
    return 0


def _worker(args: tuple[int, int, str, mp.Queue, mp.Barrier]) -> None:
    mib, repeat, device, queue, barrier = args
    barrier.wait()
    queue.put(measure(mib, repeat, device))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="buffer size in MiB (default 256)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs of each (default 5)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--processes", type=int, default=1, help="processes measuring at once (default 1)")
    parser.add_argument("--boxes", type=int, default=0, help="time a bucket of this many boxes (see above)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.boxes:
        return _bucket_main(args)
    if args.mib < 1 or args.repeat < 1 or args.processes < 1:
        parser.error("--mib, --repeat and --processes must be >= 1")
    nbytes = args.mib << 20
    if args.processes == 1:
        seconds = measure(args.mib, args.repeat, args.device)
    else:
        ctx = mp.get_context("spawn")
        queue, barrier = ctx.Queue(), ctx.Barrier(args.processes)
        procs = [ctx.Process(target=_worker, args=((args.mib, args.repeat, args.device, queue, barrier),))
                 for _ in range(args.processes)]
        for p in procs:
            p.start()
        results = [queue.get() for _ in procs]
        for p in procs:
            p.join()
        # the slowest process sets the pace, as the slowest rank does in a refit
        seconds = {name: max(r[name] for r in results) for name in operations(args.device)}
    rate = {name: args.processes * nbytes / s / 1e9 for name, s in seconds.items()}
    out = {"device": args.device, "bytes": nbytes, "repeat": args.repeat, "processes": args.processes,
           "torch_threads": torch.get_num_threads(), "compiled": buffers._native is not None,
           **{f"{name}_seconds": s for name, s in seconds.items()},
           **{f"{name}_GBps": r for name, r in rate.items()},
           "digest_vs_copy": seconds["digest"] / seconds["copy"],
           "earlier_vs_digest": seconds["earlier_digest"] / seconds["digest"],
           **({"numpy_vs_digest": seconds["numpy"] / seconds["digest"]} if "numpy" in seconds else {})}
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    form = " (compiled)" if out["compiled"] and torch.device(args.device).type == "cpu" else ""
    labels = {"digest": f"digest{form} (buffer_digests)", "digest_unaligned": f"digest{form}, 1 byte in",
              "numpy": "digest, numpy form", "numpy_unaligned": "digest, numpy form, 1 byte in",
              "earlier_digest": "earlier digest", "earlier_digest_unaligned": "earlier digest, 1 byte in",
              "copy": "plain copy"}
    rows = [(labels[name], f"{seconds[name] * 1e3:.1f} ms", f"{rate[name]:.2f}",
             f"{seconds[name] / seconds['copy']:.2f}x") for name in operations(args.device)]
    each = f", {args.processes} processes at once (GB/s: all of them)" if args.processes > 1 else ""
    print(f"{args.mib} MiB on {args.device}, median of {args.repeat}{each}")
    print(render_table(("operation", "time", "GB/s", "vs copy"), rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
