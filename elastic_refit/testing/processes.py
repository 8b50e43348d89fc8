"""Run one function on N local processes that share a rendezvous store.

Used by the multi-process tests and the benchmarks: the parent holds a ``TCPStore`` on a
free loopback port, starts the ranks, collects each rank's return value or exception, and
kills by pid whatever outlives the deadline.

Ranks are forked from a fork server that imported torch once (not forked from the caller:
gRPC and gloo threads do not survive fork; the server has none). A spawned rank would import
torch itself, seconds of CPU per rank, which on a small machine was most of a short
multi-process test. Each rank gets the caller's environment as it is at the call.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class RankResult:
    rank: int
    ok: bool
    value: Any = None
    error_type: str = ""
    error: str = ""
    exitcode: int | None = None
    seconds: float = 0.0


def nccl_rank_env(rank: int) -> dict[str, str]:
    """Environment of rank ``rank`` of a multi-rank NCCL job on this host: one GPU per rank
    when there are enough GPUs, else every rank shares GPU 0 as a host of its own (its own
    ``NCCL_HOSTID``), and the ranks talk over NCCL's socket transport on loopback: every byte
    crosses NCCL's network path, as between the nodes of a cluster."""
    import torch

    num_gpus = torch.cuda.device_count()
    env = {"ELASTIC_REFIT_CUDA_DEVICE": str(rank % max(1, num_gpus)), "NCCL_SOCKET_IFNAME": "lo",
           "NCCL_NVLS_ENABLE": "0",  # never NVLink multicast on shared hosts
           "NCCL_RAS_ENABLE": "0"}  # its process-wide sockets would outlive every communicator
    if num_gpus <= rank:
        # Unique per process, not only per rank: worlds of tests running side by side
        # (pytest-xdist workers) never claim the same host.
        env["NCCL_HOSTID"] = f"elastic-refit-rank{rank}-{os.getpid()}"
    return env


# What the fork server imports once, before it forks any rank; nothing here starts a thread
# or touches CUDA (a rank initialises CUDA itself, after its environment is set).
_PRELOAD = ["torch", "torch.distributed", "numpy", "elastic_refit.testing.world"]


def fork_server_context() -> mp.context.BaseContext:
    """The multiprocessing context the harness starts local processes with: forked from a
    server that imported torch once. The server's environment is the caller's at first use:
    pass ``dict(os.environ)`` to a process and apply it (:func:`apply_environ`)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (first use)
    return ctx


def apply_environ(environ: dict[str, str] | None) -> None:
    """Make this process's environment ``environ`` (a fork server's is the one it started with)."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, results,
           rank_env: Callable[[int], dict[str, str]] | None = None, environ: dict[str, str] | None = None) -> None:
    start = time.perf_counter()
    apply_environ(environ)
    if rank_env is not None:
        os.environ.update(rank_env(rank))  # before CUDA or NCCL initialise
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, wait_for_workers=False)
        value = fn(rank, world_size, store, *args)
        results.put(RankResult(rank, True, value, seconds=time.perf_counter() - start))
    except BaseException as exc:  # reported to the parent, which decides
        results.put(RankResult(rank, False, None, type(exc).__name__,
                               f"{exc}\n{traceback.format_exc(limit=6)}", seconds=time.perf_counter() - start))


def run_local_world(fn: Callable[..., Any], world_size: int, args: tuple = (), *, timeout_s: float = 120.0,
                    per_rank_args: list[tuple] | None = None,
                    rank_env: Callable[[int], dict[str, str]] | None = None) -> list[RankResult]:
    """Call ``fn(rank, world_size, store, *args)`` on ``world_size`` spawned processes
    (``rank_env(rank)``, a picklable function such as :func:`nccl_rank_env`, sets each
    rank's environment first).

    Returns one ``RankResult`` per rank, in rank order; a rank that died without reporting
    has ``ok=False`` and its exit code. Never leaves a child running.
    """
    ctx = fork_server_context()
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    procs = []
    for rank in range(world_size):
        extra = per_rank_args[rank] if per_rank_args else ()
        p = ctx.Process(target=_entry, args=(fn, rank, world_size, store.port, args + extra, results, rank_env,
                                             dict(os.environ)), daemon=True)
        p.start()
        procs.append(p)
    collected: dict[int, RankResult] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(collected) < world_size and time.monotonic() < deadline:
            try:
                r = results.get(timeout=0.2)
                collected[r.rank] = r
            except queue.Empty:
                if all(not p.is_alive() for p in procs):
                    # drain anything still in flight, then stop waiting for the dead
                    time.sleep(0.2)
                    while True:
                        try:
                            r = results.get_nowait()
                            collected[r.rank] = r
                        except queue.Empty:
                            break
                    break
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)
                p.join(timeout=5)
        del store
    out = []
    for rank, p in enumerate(procs):
        r = collected.get(rank)
        if r is None:
            r = RankResult(rank, False, None, "Died", f"rank {rank} exited with {p.exitcode} before reporting",
                           exitcode=p.exitcode)
        out.append(r)
    return out


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not count: it is gone once reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
