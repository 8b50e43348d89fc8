"""A transport that routes by peer: CUDA IPC between ranks of one host, a base transport
for every other byte.

:class:`IpcTransport` wraps an epoch's transport (``base``: gloo, torch NCCL or nccl4py, over
every rank of the world) and adds direct reads between the ranks that share this rank's
host (``direct_peers``): the executor takes their intra-domain messages out of its windows
and copies them straight from the source's memory
(:class:`~elastic_refit.transport.direct.DirectReads`). Posted operations, votes and aborts
go to ``base``; a GPU buffer posted to a CPU base (gloo) is staged through host memory, so a
colocated job can run with gloo alone for its control and its few network bytes.

Memory: a source shares its read buffers' IPC handles through the epoch's store once per
set of allocations (``ipc/{rank}/{generation}``; the handles are taken every refit, and a
new generation is written when one changed, even at the same address);
a reader maps each peer's allocations once per generation. Every mapping is released when
the transport is closed or aborted, i.e. on every epoch change, once the reads queued on it
are done (:meth:`IpcTransport.fence_reads`: an event after them, never a device-wide
synchronisation, which would wait for good on a collective stuck on a dead peer);
:func:`~elastic_refit.transport.cuda_ipc.open_mappings` counts what a process still has
mapped.

Unmapping (``cuIpcCloseMemHandle``) synchronises the whole device, as ``cudaFree`` does. After
a fault, the base's communicator may hold a kernel stuck on a dead peer, which ends only
when its owner aborts or shrinks it, after the transport was closed: unmapping then would
wait for good (seen on the H200: a surviving member blocked ~50 s in the release after a
peer was killed mid-refit, and missed the next epochs). So a transport that saw a fault
unmaps only once the work queued on its streams is done; until then its mappings are
*deferred* (still counted by ``open_mappings``) and :func:`release_deferred` unmaps them once
that work ended: the factory calls it when it routes the next epoch's transport, and the
communicator's owner after aborting it.

Made by :func:`elastic_refit.transport.factory.with_direct_reads`; :func:`same_host_peers`
is the routing decision (pure).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import structlog
import torch

from elastic_refit.errors import brief
from elastic_refit.layout import Buffer
from elastic_refit.transport.protocol import Capabilities, P2POp, Transport, Work
from elastic_refit.transport.schedule import BufferRef

__all__ = ["IpcTransport", "pending_releases", "release_deferred", "same_host_peers"]

log = structlog.get_logger("elastic_refit.transport")

_POLL_S = 0.01
_deferred_lock = threading.Lock()
# Mappings of faulted transports, unmapped once their guards (CUDA events after the work
# that was queued when they were released) have passed: (rank, guards, segments).
_deferred: list[tuple[int, list[Any], list[Any]]] = []


def _passed(guards: Sequence[Any]) -> bool:
    """Whether every guard event has passed (never blocks)."""
    for event in guards:
        try:
            if not event.query():
                return False
        except Exception:  # an event of a broken context: its work will not run any more
            continue
    return True


def _close_segments(rank: int, segments: Sequence[Any]) -> None:
    for seg in segments:
        try:
            seg.close()
        except Exception as exc:  # still counted by open_mappings: the leak checks see it
            log.warning("transport.ipc.unmap_failed", rank=rank, error=brief(exc))


def pending_releases() -> int:
    """Mappings of this process deferred by a faulted transport, not unmapped yet."""
    with _deferred_lock:
        return sum(len(segments) for _, _, segments in _deferred)


def release_deferred(timeout_s: float = 0.0) -> int:
    """Unmap the deferred mappings whose guards passed, waiting up to ``timeout_s`` for the
    others (polling; the device is never synchronised before their work ended). Returns how
    many mappings are still deferred."""
    deadline = time.monotonic() + timeout_s
    while True:
        with _deferred_lock:
            ready = [entry for entry in _deferred if _passed(entry[1])]
            for entry in ready:
                _deferred.remove(entry)
            left = sum(len(segments) for _, _, segments in _deferred)
        for rank, _, segments in ready:
            _close_segments(rank, segments)
            log.info("transport.ipc.released", rank=rank, deferred=True, segments=len(segments))
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(_POLL_S)


def same_host_peers(hosts: Sequence[str], rank: int) -> frozenset[int]:
    """The ranks other than ``rank`` on ``rank``'s host (``hosts[r]``: rank r's host)."""
    if not 0 <= rank < len(hosts):
        raise ValueError(f"rank {rank} is outside a world of {len(hosts)} hosts")
    return frozenset(r for r, h in enumerate(hosts) if h == hosts[rank] and r != rank)


class _StagedWork:
    """A receive of a GPU buffer through a CPU base: copied in once the base's wait returns."""

    __slots__ = ("host", "inner", "target")

    def __init__(self, inner: Work, host: torch.Tensor | None, target: torch.Tensor | None) -> None:
        self.inner, self.host, self.target = inner, host, target

    def wait(self, timeout: object = None) -> bool | None:
        return self.inner.wait(timeout) if timeout is not None else self.inner.wait()


class _Peer:
    __slots__ = ("gen", "segments", "views")

    def __init__(self, gen: int) -> None:
        self.gen = gen
        self.segments: dict[bytes, Any] = {}
        self.views: dict[BufferRef, torch.Tensor] = {}


class IpcTransport:
    """``base`` plus direct reads between the ranks of ``direct_peers`` (see the module)."""

    def __init__(self, base: Transport, store: Any, direct_peers: frozenset[int], device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"direct reads map CUDA memory; device must be a CUDA device, got {device}")
        bad = sorted(p for p in direct_peers if not 0 <= p < base.world_size or p == base.rank)
        if bad:
            raise ValueError(f"direct peers {bad} are not other ranks of a world of {base.world_size}")
        self.base = base
        self.store = store  # kept: the epoch's store, where handles are shared
        self.direct_peers = frozenset(direct_peers)
        self._capabilities = dataclasses.replace(base.capabilities, device=device)
        self._gen = 0
        self._shared: list | None = None
        self._peers: dict[int, _Peer] = {}
        self._closed = False
        self._reads: Any = None  # a CUDA event after the last direct reads queued (fence_reads)
        # An operation failed or the transport was aborted: the base may hold work stuck on
        # a dead peer, so mappings are released only once the queued work ended.
        self._faulted = False
        # Bytes received, by route, over the transport's life (benchmarks check the split).
        self.moved = {"direct": 0, "base": 0}

    # ---- the Transport protocol ------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.base.rank

    @property
    def world_size(self) -> int:
        return self.base.world_size

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    @property
    def device(self) -> torch.device:
        return self._capabilities.device

    @property
    def aborted(self) -> bool:
        return self._closed or self.base.aborted

    def post(self, ops: Sequence[P2POp]) -> tuple[Work, ...]:
        """To the base; a GPU buffer and a CPU base meet in host memory."""
        from elastic_refit.transport.direct import DIRECT_TAG

        self.moved["base"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops
                                  if op.op == "recv" and op.tag != DIRECT_TAG)
        on = self.base.device
        if all(op.tensor.device == on for op in ops):
            return self._faults(self.base.post, ops)
        moved, staged = [], []
        for op in ops:
            if op.tensor.device == on:
                moved.append(op)
                staged.append(None)
            elif op.op == "send":
                moved.append(dataclasses.replace(op, tensor=op.tensor.to(on)))
                staged.append(None)
            else:
                host = torch.empty(op.tensor.shape, dtype=op.tensor.dtype, device=on)
                moved.append(dataclasses.replace(op, tensor=host))
                staged.append((host, op.tensor))
        works = self._faults(self.base.post, moved)
        return tuple(w if s is None else _StagedWork(w, *s) for w, s in zip(works, staged, strict=True))

    def wait(self, work: Work, peer: int, what: str) -> None:
        if isinstance(work, _StagedWork):
            self._faults(self.base.wait, work.inner, peer, what)
            work.target.copy_(work.host)  # type: ignore[union-attr]
            return
        self._faults(self.base.wait, work, peer, what)

    def vote(self, ok: bool, participants: Sequence[int] | None = None) -> bool:
        return self._faults(self.base.vote, ok, participants)

    def _faults(self, fn, *args):
        """``fn(*args)``, noting a failure (see ``_faulted``)."""
        try:
            return fn(*args)
        except BaseException:
            self._faulted = True
            raise

    def interrupt(self) -> None:
        """Waits end now (the base's); the mappings stay until the transfer's own thread
        aborts or closes, so no copy it queued reads unmapped memory."""
        self.base.interrupt()

    def abort(self) -> None:
        """Release every mapping (now if nothing queued may still be running, else once it
        ended: see the module), then abort the base (peers fail fast)."""
        self._faulted = True
        self._release()
        self.base.abort()

    def close(self) -> None:
        """Release every mapping, then close the base."""
        self._release()
        self._closed = True
        self.base.close()

    # ---- direct reads ----------------------------------------------------------------
    def share(self, buffers: Mapping[BufferRef, torch.Tensor]) -> int:
        """Make ``buffers`` readable by this rank's direct peers; returns the generation
        readers map (a new one, written to the store, when an allocation changed).

        The handles are taken anew every time, not only when an address moved: memory freed
        to the driver (``torch.cuda.empty_cache()``, which colocated trainers call to make
        room for the engine) and allocated again may come back at the same address as
        another allocation, which a reader's old mapping does not show (it would read the
        old memory, and no digest covers a direct read)."""
        from elastic_refit.transport.cuda_ipc import export_tensor

        exports = [[side, name, *export_tensor(t).to_json()] for (side, name), t in sorted(buffers.items())]
        if exports != self._shared:
            self._gen += 1
            self.store.set(f"ipc/{self.rank}/{self._gen}", json.dumps(exports))
            self._shared = exports
            log.info("transport.ipc.shared", rank=self.rank, generation=self._gen, buffers=len(exports))
        return self._gen

    def peer_buffers(self, peer: int, gen: int, specs: Mapping[BufferRef, Buffer]) -> dict[BufferRef, torch.Tensor]:
        """Views of ``peer``'s buffers ``specs`` in generation ``gen`` (mapped on first use)."""
        from elastic_refit.transport.cuda_ipc import IpcExport, MappedSegment

        if peer not in self.direct_peers:
            raise ValueError(f"rank {peer} is not a direct peer of rank {self.rank}")
        state = self._peers.get(peer)
        if state is None or state.gen != gen:
            if state is not None:
                self._wait_reads()  # the old generation's views may still be read
                self._unmap(peer)
            state = self._peers[peer] = _Peer(gen)
            raw = self.store.get(f"ipc/{peer}/{gen}")
            for side, name, *exported in json.loads(raw.decode() if isinstance(raw, bytes) else raw):
                ref = (int(side), name)
                if ref not in specs:
                    continue
                e = IpcExport.from_json(exported)
                seg = state.segments.get(e.handle)
                if seg is None:
                    seg = state.segments[e.handle] = MappedSegment(e.handle, self.device)
                spec = specs[ref]
                state.views[ref] = seg.view(e.offset, e.nbytes, getattr(torch, spec.dtype), spec.shape)
            log.info("transport.ipc.mapped", rank=self.rank, peer=peer, generation=gen, buffers=len(state.views),
                     segments=len(state.segments), bytes=sum(seg.nbytes for seg in state.segments.values()))
        missing = sorted(set(specs) - set(state.views))
        if missing:
            raise ValueError(f"rank {peer} shared no buffer {missing[0][1]!r} in generation {gen}")
        return {ref: state.views[ref] for ref in specs}

    def fence_reads(self) -> None:
        """The direct reads queued so far on the current stream read mapped memory: no
        mapping is released before they are done."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._reads = event

    @property
    def num_mapped(self) -> int:
        """Allocations of peers this transport has mapped now."""
        return sum(len(p.segments) for p in self._peers.values())

    def _unmap(self, peer: int) -> None:
        state = self._peers.pop(peer, None)
        if state is None:
            return
        state.views.clear()
        for seg in state.segments.values():
            try:
                seg.close()
            except Exception as exc:  # still counted by open_mappings: the leak checks see it
                log.warning("transport.ipc.unmap_failed", rank=self.rank, peer=peer, error=brief(exc))

    def _wait_reads(self) -> None:
        """No read in flight touches what is unmapped next. Only the reads: a device-wide
        synchronisation would also wait for the base's collectives, and one stuck on a peer
        that died (the reason for an abort) ends only when its communicator is aborted,
        which comes after the release."""
        reads, self._reads = self._reads, None
        if reads is not None:
            try:
                reads.synchronize()
            except Exception as exc:
                log.warning("transport.ipc.sync_failed", rank=self.rank, error=brief(exc))

    def _guards(self) -> list[Any]:
        """Events after everything queued so far that may touch mapped memory or hold the
        device: the direct reads, the current stream (a c10d wait makes it wait for the
        communicator's stream) and the base's own stream (nccl4py)."""
        guards = [self._reads] if self._reads is not None else []
        streams = [torch.cuda.current_stream(self.device)]
        own = getattr(self.base, "stream", None)
        if own is not None:
            streams.append(own)
        for stream in streams:
            event = torch.cuda.Event()
            event.record(stream)
            guards.append(event)
        return guards

    def _release(self) -> None:
        release_deferred()  # an earlier epoch's, whose communicator has been dealt with since
        if not self._peers:
            return
        if not (self._faulted or self.base.aborted):
            self._wait_reads()
            for peer in list(self._peers):
                self._unmap(peer)
            log.info("transport.ipc.released", rank=self.rank)
            return
        # After a fault: unmapping synchronises the device, and the base may hold a kernel
        # stuck on a dead peer until its owner aborts the communicator (after this close).
        guards = self._guards()
        self._reads = None
        segments = []
        for peer in list(self._peers):
            state = self._peers.pop(peer)
            state.views.clear()
            segments.extend(state.segments.values())
        if _passed(guards):
            _close_segments(self.rank, segments)
            log.info("transport.ipc.released", rank=self.rank)
            return
        with _deferred_lock:
            _deferred.append((self.rank, guards, segments))
        log.info("transport.ipc.release_deferred", rank=self.rank, segments=len(segments))
