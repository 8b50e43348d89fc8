"""Direct reads (CUDA IPC between ranks of one host), their CPU-testable parts: the routing
decision (which peers, which messages), the copies a reader derives from the plan (gather,
scatter, staged), and the copies themselves run on CPU tensors of every rank in one process
(the torch reference and the Triton kernel in its interpreter). The mapping of a peer's
memory is the one part a CPU cannot run: the double below hands out the peer's own tensors
where the IPC transport hands out views of its mapped memory (tests/gpu covers that)."""

from __future__ import annotations

import json

import pytest
import torch

from elastic_refit.errors import TransportAborted
from elastic_refit.layout import Buffer, parse_spec
from elastic_refit.layout.core import Topology
from elastic_refit.layout.models import ModelConfig
from elastic_refit.layout.refit import model_refit_spec
from elastic_refit.plan import PlanOptions, SourceSide, TransferKind, make_plan
from elastic_refit.testing.pattern import allocate, check_pieces, fill_pieces
from elastic_refit.transport.direct import DirectReads, plan_direct_copies, split_direct
from elastic_refit.transport.executor import ExecutorOptions
from elastic_refit.transport.factory import with_direct_reads
from elastic_refit.transport.ipc import IpcTransport, same_host_peers
from elastic_refit.transport.protocol import Backend, Capabilities
from elastic_refit.transport.schedule import build_rank_schedule

TINY_MOE = ModelConfig(name="tiny-moe", hidden_size=32, num_layers=2, vocab_size=70, num_heads=4,
                       num_kv_heads=2, head_dim=8, intermediate_size=0, num_experts=4,
                       moe_intermediate_size=16, qk_norm=True)


def _plan(domains=(0,) * 8, layers=1, bucket=4 << 20, model="qwen3-30b-a3b"):
    spec = model_refit_spec(model, "tp=2,pp=2,ep=2", "tp=2,dp=2", domain_size=8, num_layers=layers)
    return make_plan(spec.source, spec.destination, Topology(tuple(domains)),
                     PlanOptions(bucket_bytes=bucket, direct_min_bytes=256 << 10, relay="off"))


def test_same_host_peers():
    hosts = ("a", "a", "b", "b", "a", "a", "b", "b")
    assert same_host_peers(hosts, 0) == {1, 4, 5}
    assert same_host_peers(hosts, 6) == {2, 3, 7}
    assert same_host_peers(("a", "b"), 0) == frozenset()
    with pytest.raises(ValueError, match="outside"):
        same_host_peers(hosts, 8)


class _Base:
    """A transport of one rank that never moves a byte (the routing tests need its shape)."""

    def __init__(self, rank, world_size, device="cpu"):
        self.rank, self.world_size = rank, world_size
        self.capabilities = Capabilities(Backend.GLOO, torch.device(device))
        self.device = self.capabilities.device
        self.aborted = False

    def close(self):
        self.aborted = True

    def abort(self):
        self.aborted = True


def test_with_direct_reads_routes_by_host():
    gpu = _Base(0, 4, device="cuda:0")
    assert with_direct_reads(gpu, None, ("a", "b", "c", "d"), device="cuda:0") is gpu  # nobody to read from
    base = _Base(0, 4)
    alone = with_direct_reads(base, None, ("a", "b", "c", "d"), device="cuda:0")  # GPU buffers over gloo
    assert isinstance(alone, IpcTransport) and alone.direct_peers == frozenset() and alone.device.type == "cuda"
    routed = with_direct_reads(base, None, ("a", "a", "b", "a"), device="cuda:0")
    assert isinstance(routed, IpcTransport) and routed.direct_peers == {1, 3}
    assert routed.device == torch.device("cuda:0") and routed.capabilities.backend is Backend.GLOO
    routed.close()
    assert base.aborted and routed.aborted
    with pytest.raises(ValueError, match="hosts names 3 ranks"):
        with_direct_reads(base, None, ("a", "a", "b"))
    with pytest.raises(ValueError, match="CUDA device"):
        IpcTransport(base, None, frozenset({1}), torch.device("cpu"))
    with pytest.raises(ValueError, match="not other ranks"):
        IpcTransport(base, None, frozenset({0}), torch.device("cuda:0"))


def test_split_takes_only_intra_messages_of_direct_peers():
    plan = _plan(domains=(0, 0, 1, 1, 0, 0, 1, 1))
    hosts = ("a", "a", "b", "b", "a", "a", "b", "b")
    for rank in range(8):
        schedule = build_rank_schedule(plan, rank)
        split = split_direct(schedule, same_host_peers(hosts, rank))
        kept = [m for s in split.schedule.steps for m in (s.send, s.recv) if m is not None]
        taken = [m for _, _, m in split.sends + split.recvs]
        assert all(m.kind == TransferKind.INTRA and hosts[m.peer] == hosts[rank] for m in taken)
        assert all(m.kind == TransferKind.NETWORK for m in kept)  # host == domain here
        by_kind = schedule.bytes_by_kind()
        assert sum(m.nbytes for _, _, m in split.recvs) == by_kind["intra_recv"]
        assert sum(m.nbytes for _, _, m in split.sends) == by_kind["intra_send"]


def test_reader_copies_are_mostly_one_copy():
    plan = _plan(layers=2)
    me = 4
    schedule = build_rank_schedule(plan, me)
    split = split_direct(schedule, frozenset(set(range(8)) - {me}))
    senders = {p: build_rank_schedule(plan, p) for p in {m.peer for _, _, m in split.recvs}}
    copies = plan_direct_copies(split.recvs, me, senders, schedule, 64 << 20)
    assert copies.nbytes == schedule.bytes_by_kind()["intra_recv"] > 0
    one_copy = copies.nbytes - copies.staged_bytes
    assert one_copy >= 0.8 * copies.nbytes, (one_copy, copies.nbytes)
    assert all(n <= 64 << 20 for _, _, n in copies.staged)


# Boxes strided on both sides ("cube": staged), contiguous at the source only ("cols":
# scattered), contiguous at the destination ("rows": gathered).
MIXED_SPEC = {
    "domains": [0, 0, 0, 0],
    "tensors": [
        {"name": "cube", "shape": [4, 8, 6], "dtype": "float32",
         "source": {"mesh": [0, 1], "placements": ["S(2)"]},
         "destination": {"mesh": [2, 3], "placements": ["S(1)"]}},
        {"name": "cols", "shape": [8, 6], "dtype": "bfloat16",
         "source": {"mesh": [0, 1], "placements": ["S(1)"]},
         "destination": {"mesh": [2], "placements": ["R"]}},
        {"name": "rows", "shape": [8, 6], "dtype": "int8",
         "source": {"mesh": [0, 1], "placements": ["S(0)"]},
         "destination": {"mesh": [3], "placements": ["R"]}},
    ],
}


def _mixed_plan():
    spec = parse_spec(MIXED_SPEC)
    return make_plan(spec.source, spec.destination, spec.topology, PlanOptions(bucket_bytes=256, relay="off"))


def test_reader_copies_of_every_kind():
    plan = _mixed_plan()
    kinds = {}
    for me in (2, 3):
        schedule = build_rank_schedule(plan, me)
        split = split_direct(schedule, frozenset({0, 1, 2, 3} - {me}))
        senders = {p: build_rank_schedule(plan, p) for p in {m.peer for _, _, m in split.recvs}}
        copies = plan_direct_copies(split.recvs, me, senders, schedule, 256)
        kinds[me] = (len(copies.gather), len(copies.scatter), copies.staged_bytes)
        assert copies.nbytes == schedule.bytes_by_kind()["intra_recv"]
        with pytest.raises(ValueError, match="above the budget"):
            plan_direct_copies(split.recvs, me, senders, schedule, 8)
    assert kinds[2][1] > 0 and kinds[2][2] > 0 and kinds[3][0] > 0, kinds


class _Peers:
    """A world's direct reads in one process: every rank's buffers are at hand, so a
    reader's "mapping" of a peer is the peer's own tensors (see the module docstring)."""

    def __init__(self, plan, rank, buffers, device, world_size):
        self.rank, self.world_size = rank, world_size
        self.capabilities = Capabilities(Backend.GLOO, device)
        self.device = device
        self.direct_peers = frozenset(set(range(world_size)) - {rank})
        self.plan, self.buffers = plan, buffers
        self.shared = 0

    def share(self, tensors):
        self.shared += 1
        return 7

    def peer_buffers(self, peer, gen, specs):
        assert gen == 7
        src, dst = self.buffers[peer]
        return {ref: (src if ref[0] == int(SourceSide.SOURCE) else dst)[ref[1]] for ref in specs}

    def post(self, ops):
        for op in ops:
            if op.op == "recv":
                op.tensor.fill_(7)
        return tuple(None for _ in ops)

    def wait(self, work, peer, what):
        pass


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", ["tiny-moe", "mixed"])
def test_direct_reads_land_every_byte(backend, case):
    if backend == "triton":
        pytest.importorskip("triton")
    plan = _plan(layers=2, bucket=1 << 10, model=TINY_MOE) if case == "tiny-moe" else _mixed_plan()
    world = plan.source.ranks + plan.destination.ranks
    device = torch.device("cpu")
    buffers = {}
    for r in world:
        src = allocate(plan.source, r, fill=0, device=device)
        fill_pieces(plan.source, r, src, seed=5)
        buffers[r] = (src, allocate(plan.destination, r, fill=0x5A, device=device))
    # A small staging budget forces several staged groups.
    options = ExecutorOptions(staging_bytes=256, pack_backend=backend)
    readers = {}
    for r in world:
        schedule = build_rank_schedule(plan, r)
        readers[r] = DirectReads(plan, schedule, _Peers(plan, r, buffers, device, len(world)), options)
        assert not any(s.send or s.recv for s in readers[r].network_schedule.steps)
    for r in world:
        src, dst = buffers[r]
        tensors = {(int(SourceSide.SOURCE), n): t for n, t in src.items()}
        tensors.update({(int(SourceSide.DESTINATION), n): t for n, t in dst.items()})
        readers[r].run(tensors)
    for r in plan.destination.ranks:
        assert check_pieces(plan.destination, r, buffers[r][1], seed=5) == []
    assert sum(readers[r].nbytes for r in world) == sum(
        build_rank_schedule(plan, r).bytes_by_kind()["intra_recv"] for r in world)


class _Store:
    def __init__(self):
        self.kv = {}

    def set(self, key, value):
        self.kv[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.kv[key]


class _Segment:
    """A mapping of a peer's allocation, as the IPC transport sees one (no CUDA here)."""

    def __init__(self, handle, device):
        self.handle, self.nbytes, self.closed = handle, 1 << 20, False

    def view(self, offset, nbytes, dtype, shape):
        return torch.empty(shape, dtype=dtype)

    def close(self):
        self.closed = True


class _Event:
    done = True  # whether recorded work has ended (the class's: every event of a test)

    def __init__(self):
        self.waited = False

    def record(self, stream):
        pass

    def synchronize(self):
        self.waited = True

    def query(self):
        return _Event.done


def test_releasing_mappings_waits_for_the_reads_never_for_the_device(monkeypatch):
    """A clean close (an epoch change after a refit that passed) waits for the direct reads
    queued on the transport, then unmaps; never a device-wide synchronisation (a parked
    communicator's collective may be stuck on a dead peer)."""
    from elastic_refit.transport import cuda_ipc
    from elastic_refit.transport.cuda_ipc import HANDLE_BYTES, IpcExport

    def device_sync(*_a, **_k):
        raise AssertionError("the device was synchronised")

    monkeypatch.setattr(torch.cuda, "synchronize", device_sync)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    made = []
    monkeypatch.setattr(cuda_ipc, "MappedSegment", lambda h, d: made.append(_Segment(h, d)) or made[-1])
    store = _Store()
    for gen in (1, 2):
        store.set(f"ipc/1/{gen}", json.dumps([[0, "w", *IpcExport(bytes([gen]) * HANDLE_BYTES, 0, 64).to_json()]]))
    base = _Base(0, 2)
    ipc = IpcTransport(base, store, frozenset({1}), torch.device("cuda:0"))
    specs = {(0, "w"): Buffer(1, "w", (4, 4), "float32")}
    ipc.peer_buffers(1, 1, specs)
    ipc.fence_reads()
    first_reads = ipc._reads
    ipc.peer_buffers(1, 2, specs)  # the peer's buffers moved: generation 1 goes, once read
    assert first_reads.waited and made[0].closed and not made[1].closed and ipc.num_mapped == 1
    ipc.fence_reads()
    second_reads = ipc._reads
    ipc.close()
    assert second_reads.waited and made[1].closed and ipc.num_mapped == 0 and base.aborted


class _StuckBase(_Base):
    """An nccl4py-like base (its own stream) whose vote failed on a peer that died."""

    stream = "nccl-stream"

    def vote(self, ok, participants=None):
        raise TransportAborted("rank 0: completion vote with rank -1 failed: NCCL error 6", rank=0)


@pytest.mark.parametrize("end", ["close", "abort"])
def test_after_a_fault_mappings_wait_for_the_stuck_work_not_the_device(monkeypatch, end):
    """The H200 colocated trials: a surviving member's vote failed on a killed peer, and
    releasing its mappings (cuIpcCloseMemHandle, which synchronises the device) blocked ~50 s
    behind the vote's kernel, stuck until its communicator is aborted, which comes after
    the release: the member missed the next epochs and versions 2 and 3 were lost. Now the
    release never waits: the mappings are deferred while the work queued on the transport's
    streams has not ended, still counted, and go once it ended (the communicator aborted)."""
    from elastic_refit.transport import cuda_ipc
    from elastic_refit.transport import ipc as ipc_module
    from elastic_refit.transport.cuda_ipc import HANDLE_BYTES, IpcExport
    from elastic_refit.transport.factory import release_deferred_mappings

    def device_sync(*_a, **_k):
        raise AssertionError("the device was synchronised")

    monkeypatch.setattr(torch.cuda, "synchronize", device_sync)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    made = []

    class _SyncingSegment(_Segment):
        def close(self):
            if not _Event.done:  # what cuIpcCloseMemHandle does: wait for the whole device
                raise AssertionError("unmapped while a kernel was stuck: this waits for good")
            super().close()

    monkeypatch.setattr(cuda_ipc, "MappedSegment", lambda h, d: made.append(_SyncingSegment(h, d)) or made[-1])
    store = _Store()
    store.set("ipc/1/1", json.dumps([[0, "w", *IpcExport(b"\x01" * HANDLE_BYTES, 0, 64).to_json()]]))
    base = _StuckBase(0, 2)
    ipc = IpcTransport(base, store, frozenset({1}), torch.device("cuda:0"))
    ipc.peer_buffers(1, 1, {(0, "w"): Buffer(1, "w", (4, 4), "float32")})
    ipc.fence_reads()
    monkeypatch.setattr(_Event, "done", False)  # the vote's kernel never ends on its own
    with pytest.raises(TransportAborted):
        ipc.vote(True)
    getattr(ipc, end)()  # returns at once
    assert base.aborted and ipc.num_mapped == 0
    assert not made[0].closed and ipc_module.pending_releases() == 1  # still counted: not leaked silently
    assert release_deferred_mappings(0.05) == 1  # bounded: the kernel is still stuck
    monkeypatch.setattr(_Event, "done", True)  # the owner aborted the communicator: the kernel ended
    assert release_deferred_mappings() == 0 and made[0].closed and ipc_module.pending_releases() == 0


def test_after_a_fault_with_nothing_stuck_mappings_go_at_once(monkeypatch):
    """A fault that left no work queued (e.g. a refused plan) unmaps at the close itself."""
    from elastic_refit.transport import cuda_ipc
    from elastic_refit.transport import ipc as ipc_module
    from elastic_refit.transport.cuda_ipc import HANDLE_BYTES, IpcExport

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(_Event, "done", True)
    made = []
    monkeypatch.setattr(cuda_ipc, "MappedSegment", lambda h, d: made.append(_Segment(h, d)) or made[-1])
    store = _Store()
    store.set("ipc/1/1", json.dumps([[0, "w", *IpcExport(b"\x02" * HANDLE_BYTES, 0, 64).to_json()]]))
    ipc = IpcTransport(_StuckBase(0, 2), store, frozenset({1}), torch.device("cuda:0"))
    ipc.peer_buffers(1, 1, {(0, "w"): Buffer(1, "w", (4, 4), "float32")})
    ipc.abort()
    assert made[0].closed and ipc_module.pending_releases() == 0


def test_a_faulty_transport_keeps_the_direct_reads_of_the_transport_it_wraps():
    """Chaos wraps a member's transport only where a fault may fire: unforwarded, that rank
    would move its same-host messages through post() while its peers read them directly."""
    from elastic_refit.testing.faults import FaultyTransport

    assert getattr(FaultyTransport(_Base(0, 2)), "direct_peers", None) is None
    plan = _plan(layers=1, bucket=1 << 10, model=TINY_MOE)
    peers = _Peers(plan, 4, {}, torch.device("cpu"), 8)
    wrapped = FaultyTransport(peers)
    assert wrapped.direct_peers == peers.direct_peers and wrapped.share({}) == 7
    fired = []
    wrapped.inject(lambda: fired.append(True), after=0, op="recv")
    with pytest.raises(KeyError):  # _Peers has no buffers here: the mapping itself is not the point
        wrapped.peer_buffers(0, 7, {(0, "x"): None})
    assert fired == [True]  # mapping a peer counts as a receive: a transfer fault can fire there


def test_ipc_handles_keep_their_nul_bytes():
    """A CUDA IPC handle is 64 raw bytes with many NULs: read as a ``c_char`` array (a C
    string) it was cut at the first, and assigned as one the rest was dropped; every
    export failed (a handle of fewer than 64 bytes) and no import named its allocation."""
    from elastic_refit.transport.cuda_ipc import HANDLE_BYTES, IpcExport, _handle_bytes, _handle_of

    raw = bytes([0x41, 0, 0, 7] + [0] * 28 + list(range(1, 33)))
    assert len(raw) == HANDLE_BYTES
    handle = _handle_of(raw)
    assert _handle_bytes(handle) == raw
    assert IpcExport.from_json(IpcExport(raw, 16, 64).to_json()).handle == raw
    with pytest.raises(ValueError, match="64 bytes"):
        _handle_of(raw[:10])


def test_a_source_shares_a_new_generation_when_an_allocation_changes_at_the_same_address(monkeypatch):
    """Memory freed to the driver (empty_cache) and allocated again can sit at the same
    address in another allocation: a reader's old mapping would not show it. The handles are
    compared every refit, not the addresses."""
    from elastic_refit.transport import cuda_ipc
    from elastic_refit.transport.cuda_ipc import HANDLE_BYTES, IpcExport

    allocation = {"handle": b"\x01" * HANDLE_BYTES}
    monkeypatch.setattr(cuda_ipc, "export_tensor", lambda t: IpcExport(allocation["handle"], 0, 64))
    store = _Store()
    ipc = IpcTransport(_Base(0, 2), store, frozenset({1}), torch.device("cuda:0"))
    w = torch.zeros(16)
    assert ipc.share({(0, "w"): w}) == 1
    assert ipc.share({(0, "w"): w}) == 1 and list(store.kv) == ["ipc/0/1"]  # nothing changed: no write
    allocation["handle"] = b"\x02" * HANDLE_BYTES  # same tensor, same address, another allocation
    assert ipc.share({(0, "w"): w}) == 2 and "ipc/0/2" in store.kv
