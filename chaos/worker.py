"""Warm member processes for chaos trials, reused across trials.

A worker is a spawned process that imports torch and the runtime once, then runs one
member (``run_member``) per task it receives over its pipe and reports back, so a trial
pays no import time. A worker the fault killed is simply gone; the pool replaces it.
SIGTERM while a member runs raises :class:`Terminated` in the worker's main thread: the
member's ``ElasticRefit`` context closes (a graceful leave, its lease revoked).

After each member the worker reports the TCP sockets and threads it still holds beyond
its idle baseline: what a closed ``ElasticRefit`` leaks (less gRPC's process-wide poller
thread and pooled etcd connection, which are shared and do not grow); on a GPU also the
other processes' memory it still maps (CUDA IPC) and the bytes of live tensors before and
after the member.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import signal
import sys
import threading
import time
import traceback
import types
import warnings
from typing import Any

__all__ = ["Terminated", "cuda_allocated", "ipc_mappings", "open_tcp_sockets", "worker_main"]


class Terminated(BaseException):
    """SIGTERM arrived while a member was running."""


def open_tcp_sockets(pid: int | str = "self") -> list[str]:
    """``local->remote state`` of the TCP sockets (IPv4/6) process ``pid`` holds open."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    with contextlib.suppress(OSError):
        for fd in os.listdir(fd_dir):
            with contextlib.suppress(OSError):
                target = os.readlink(f"{fd_dir}/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as fh:
            next(fh)
            for line in fh:
                parts = line.split()
                if len(parts) > 9 and parts[9] in inodes:
                    out.append(f"{parts[1]}->{parts[2]} st={parts[3]}")
    return out


def _os_thread_alive(thread: threading.Thread) -> bool:
    """Python keeps a ``_DummyThread`` entry for every C++ thread that ever called into it
    (gloo's threads call the etcd store) and never removes it; the OS thread decides."""
    native = getattr(thread, "native_id", None)
    if not isinstance(thread, threading._DummyThread) or native is None:
        return True
    return os.path.exists(f"/proc/self/task/{native}")


def _remote_port(socket_line: str) -> int:
    """Remote port of an ``open_tcp_sockets`` line (``local->remote st=..``, hex ports)."""
    return int(socket_line.split("->")[1].split()[0].rsplit(":", 1)[1], 16)


def _settled_leftovers(baseline_threads: int, sockets_before: set[str], etcd_endpoints: tuple[str, ...],
                       wait_s: float = 4.0) -> tuple[list[str], list[str]]:
    """Sockets the member opened and left open, and extra threads, given ``wait_s`` to go
    away: gRPC and gloo close asynchronously, and an aborted group's last send/recv waits
    drain within the runtime's per-wait bound (lease TTL + 1 s).

    gRPC keeps a closed channel's subchannel to an etcd endpoint in its process-wide pool
    (measured: one connection per endpoint, reused across sessions and replaced when etcd
    restarts, never more): up to one per endpoint is not a leak; anything else is."""
    etcd_ports = {int(e.rsplit(":", 1)[1]) for e in etcd_endpoints}
    deadline = time.monotonic() + wait_s
    while True:
        sockets = open_tcp_sockets()
        pooled = [x for x in sockets if _remote_port(x) in etcd_ports]
        new = [x for x in sockets if x not in sockets_before]
        leaked = new if (len(pooled) > len(etcd_ports) or any(x not in pooled for x in new)) else []
        # gRPC's aio poller is one thread per process, started on first use, by design.
        threads = [t.name for t in threading.enumerate()[baseline_threads:]
                   if "_poll_wrapper" not in t.name and _os_thread_alive(t)]
        if (not leaked and not threads) or time.monotonic() > deadline:
            return leaked, threads
        time.sleep(0.1)


def _describe(obj: object) -> str:
    """One referrer, briefly: a frame by its function and line, a dict by its owner's type."""
    if isinstance(obj, types.FrameType):
        return f"frame {obj.f_code.co_name}:{obj.f_lineno}"
    if isinstance(obj, dict):
        return "dict"
    return type(obj).__qualname__


def _held_by_frames(obj: object) -> str:
    """Running frames (any thread) with ``obj`` among their locals: on Python 3.11 a running
    function's locals are no referrer ``gc`` can see."""
    hits = []
    for ident, frame in sys._current_frames().items():
        while frame is not None:
            if frame.f_code.co_name not in ("_held_by_frames", "group_holders") \
                    and any(v is obj for v in frame.f_locals.values()):
                hits.append(f"{_describe(frame)} (thread {ident})")
            frame = frame.f_back
    return f" [locals of {', '.join(hits)}]" if hits else ""


def group_holders(depth: int = 3, limit: int = 8) -> list[str]:
    """What still references the transports and posted-work handles alive in this process,
    ``depth`` referrers up (a diagnostic for a leaked socket: gloo closes a pair's socket
    only when its process group goes, so whoever holds the group holds the socket)."""
    from elastic_refit.transport import c10d

    gc.disable()  # the walk must not collect what it is looking at
    try:
        with warnings.catch_warnings():  # isinstance on torch's deprecated module attributes warns
            warnings.simplefilter("ignore")
            live = [o for o in gc.get_objects() if isinstance(o, (c10d.C10dTransport, c10d._Works))]
        out = []
        del live[limit:]
        for obj in live:
            chain, here, up = [type(obj).__qualname__], obj, []
            for _ in range(depth):
                # The walk's own lists and frame are not holders (and keeping a reference to
                # the frame here would make a cycle that holds the transports).
                up = [r for r in gc.get_referrers(here) if r is not live and r is not up
                      and getattr(r, "f_code", None) is not group_holders.__code__]
                if not up:
                    chain.append("(no Python referrer)")
                    break
                chain.append(" | ".join(sorted({_describe(r) for r in up}))[:160])
                here = up[0]
            out.append(" <- ".join(chain) + _held_by_frames(obj))
        # sys._current_frames() stays inside the comprehension: held in a local here, it
        # would hold this frame (and ``live``) in a cycle after the return.
        stacks = [f"thread {t.name}: {_describe(sys._current_frames().get(t.ident))}"
                  for t in threading.enumerate() if t is not threading.current_thread()]
        return out + stacks[:limit]
    finally:
        gc.enable()


def ipc_mappings() -> list[str]:
    """Other processes' GPU memory this process still maps over CUDA IPC (``address+bytes``);
    none where nothing imported the IPC module (no direct reads ran here)."""
    module = sys.modules.get("elastic_refit.transport.cuda_ipc")
    return module.mapped() if module is not None else []


def cuda_allocated() -> int | None:
    """Bytes of this process's live tensors on its GPU, after a collection (None while it
    has not used a GPU: nothing to measure, and no CUDA context is made for it)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    gc.collect()
    return int(torch.cuda.memory_allocated())


def _run_member(member, hook, conn) -> dict[str, Any]:
    """``run_member``, but a member that reached the last version stays in the job (serving,
    holding its shard) until the parent says stop: a restarted rank can always catch up from
    live peers, and the job's end is not a membership change mid-trial."""
    from elastic_refit.testing.faults import fault_hooks
    from elastic_refit.testing.job import run_member

    def hold_until_stop(refit) -> None:
        conn.send(("reached", {"member_id": member.member_id, "incarnation": member.incarnation}))
        while not conn.poll(0.1):
            # Raises the agent's error (e.g. MembershipLost) if it failed while we wait.
            with contextlib.suppress(TimeoutError):
                refit.wait_for_version(10**9, timeout_s=0.0)
        conn.recv()

    return run_member(member, hold=hold_until_stop, hooks=fault_hooks(hook) if hook is not None else None)


def worker_main(conn, gpu: bool = False) -> None:
    """Entry point of a worker process: serve tasks from ``conn`` until None or EOF. With
    ``gpu``, the worker is a host of its own to NCCL (its own ``NCCL_HOSTID``), so several
    workers share one GPU over NCCL's socket transport."""
    if gpu:
        # NCCL's RAS service is process-wide: its sockets outlive every communicator, and the
        # oracle would count them as the member's leak.
        os.environ.update({"NCCL_HOSTID": f"elastic-refit-chaos-{os.getpid()}", "NCCL_SOCKET_IFNAME": "lo",
                           "NCCL_NVLS_ENABLE": "0", "NCCL_RAS_ENABLE": "0"})
    import torch
    from elastic_refit.chaos.inject import reset_state

    from elastic_refit.log import configure_logging

    torch.set_num_threads(1)  # 2 cores, many processes
    running = {"member": False}

    def on_term(signum, frame):
        if running["member"]:
            raise Terminated()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    # A member the runner finds hung gets SIGUSR2: every thread's stack goes to fd 2, which
    # each task points at its member's .stderr file.
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    # A fatal signal (a library's segfault or abort) writes every thread's stack there too:
    # the trial then names the crash with its exit code and the stack says where.
    faulthandler.enable(all_threads=True)
    # The process's gloo device (one listener, shared by every group: transport.factory) is
    # the worker's from the start, as in a long-lived trainer: a member's groups add none.
    from elastic_refit.transport.factory import gloo_device

    gloo_device()
    baseline_threads = threading.active_count()
    devnull = open(os.devnull, "w")  # noqa: SIM115 - for the process lifetime
    conn.send(("ready", os.getpid()))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        member, hook, log_path = task
        # C++ noise (gloo connection errors) goes to the member's own file.
        err = os.open(log_path.removesuffix(".log") + ".stderr", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(err, 2)
        os.close(err)
        reset_state()
        terminated = False
        sockets_before = set(open_tcp_sockets())
        allocated_before = cuda_allocated()
        with open(log_path, "a", buffering=1) as log_file:
            configure_logging(json=True, stream=log_file)
            start = time.monotonic()
            try:
                running["member"] = True
                report: dict[str, Any] = _run_member(member, hook, conn)
            except Terminated:
                terminated = True
                report = {"member_id": member.member_id, "error_type": "Terminated", "error": "SIGTERM"}
            except BaseException as exc:
                report = {"member_id": member.member_id, "error_type": type(exc).__name__,
                          "error": f"{exc}\n{traceback.format_exc(limit=4)}"[:2000]}
            finally:
                running["member"] = False
            report["seconds"] = time.monotonic() - start
            report["incarnation"] = member.incarnation
            # Only sockets this member opened count (the runner retires a worker that leaked).
            sockets, threads = _settled_leftovers(baseline_threads, sockets_before, member.etcd)
            report["leftover_sockets"] = sockets
            if sockets:
                report["leftover_socket_holders"] = group_holders()
            report["leftover_threads"] = threads
            report["leftover_ipc_mappings"] = ipc_mappings()
            report["cuda_allocated_before"] = allocated_before
            report["cuda_allocated_after"] = cuda_allocated()
        configure_logging(json=True, stream=devnull)  # late events of this member go nowhere
        with contextlib.suppress(Exception):
            conn.send(("report", report))
        if terminated:
            return  # a terminated process exits, as it would in production
