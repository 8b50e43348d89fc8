"""FSDP2 x TP trainer -> TP inference engine: refit a small Hugging Face Qwen3 on CPU (gloo).

    python examples/fsdp2_tp_refit.py [--dtype float32|bfloat16] [--versions 2] [--etcd HOST:PORT]

Four trainer processes form their own torch.distributed world, a dp=2 x tp=2 mesh: tensor
parallelism the torchtitan way (``parallelize_module`` on each decoder layer: q/k/v/gate/up
column-wise, o/down row-wise; the embedding and the LM head vocab-sharded) and then FSDP2
(``fully_shard``) on the dp axis, per layer and then the root. Two inference processes form
another, separate world: a tp=2 mesh with the same TP plan and no FSDP (the "engine").

After each optimizer step (AdamW on a fixed random batch, LM loss) the trainers publish the
version through elastic-refit. Each side describes only itself, from its own DTensors
(``from_dtensors(model)``); nothing else passes between the sides but the refit. Trainers and
engine then run the same probe input; the parent checks per version that every engine rank's
logits equal the trainer's bit for bit, prints a table and exits 1 on any mismatch or failure.
The engine starts from NaN weights, so every element it reads must have come through the
refit; the trainers publish version v + 1 only after the engine has reported version v.

Without ``--etcd`` a local etcd is started (``elastic_refit.testing.EtcdServer``) and stopped
at the end. Needs ``transformers`` (``pip install -e .[examples]``); no hub download.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import math
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, field

NUM_TRAINERS, NUM_ENGINES = 4, 2  # trainers: dp=2 x tp=2; engine: tp=2
DP, TP = 2, 2
BATCH, SEQ, PROBE_BATCH = 4, 16, 2
LR = 1e-2
SEED = 0
DTYPES = ("float32", "bfloat16")


# --- the model and its parallelisation (the user's own training / serving code) ----------

def model_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=SEQ,
                       tie_word_embeddings=False, attention_dropout=0.0, use_cache=False)


def build_model(dtype):
    """The same Qwen3 on every rank (same seed), in ``dtype``."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(SEED)
    return Qwen3ForCausalLM(model_config()).to(dtype)


def replicate_parallel():
    """A TP style for modules that see the same (replicated) activations on every TP rank, the
    RMSNorms of the residual stream: their parameters become DTensors replicated on the TP
    mesh, inputs and outputs stay plain tensors (torchtitan's ``NoParallel``)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class ReplicateParallel(ParallelStyle):
        def _apply(self, module, device_mesh):
            def to_dtensor(mod, inputs, mesh):
                x = inputs[0]
                if not isinstance(x, DTensor):
                    x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
                return (x, *inputs[1:])

            def to_local(mod, outputs, mesh):
                return outputs.to_local() if isinstance(outputs, DTensor) else outputs

            return distribute_module(module, device_mesh, None, to_dtensor, to_local)

    return ReplicateParallel()


def apply_tp(model, tp_mesh) -> None:
    """Megatron-style TP without sequence parallelism, the same plan on trainer and engine.

    q_norm / k_norm act on head-sharded activations: like torchtitan's Qwen3 they are
    SequenceParallel on the heads dim (2), so that their replicated weights get the gradient
    summed over all heads. (As plain replicas, each TP rank would train its own copy on its own
    heads and the copies would drift apart after the first step.)
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(model, tp_mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "model.norm": replicate_parallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, {
            "input_layernorm": replicate_parallel(),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "self_attn.o_proj": RowwiseParallel(),
            "post_attention_layernorm": replicate_parallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        })


def apply_fsdp(model, dp_mesh) -> None:
    """FSDP2 on the dp axis: each decoder layer, then the root (embedding, final norm, head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=True)


def train_batch(dp_rank: int):
    """This dp rank's share of one fixed random batch (input ids, also the LM labels)."""
    import torch

    ids = torch.randint(0, model_config().vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return ids.chunk(DP)[dp_rank]


def probe_input():
    import torch

    return torch.randint(0, model_config().vocab_size, (PROBE_BATCH, SEQ), generator=torch.Generator().manual_seed(2))


def probe_logits(model):
    import torch

    with torch.no_grad():
        return model(input_ids=probe_input(), use_cache=False).logits


def init_world(rank: int, world_size: int, port: int, timeout_s: float) -> None:
    """This side's own torch.distributed world (trainers and engine each have one)."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def to_bytes(tensor) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(tensor.detach().clone(), buf)
    return buf.getvalue()


def from_bytes(data: bytes):
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


# --- the refit: every call of elastic-refit is in these few functions -----------------------

def refit_config(args: dict, role: str, member_id: str, rank: int):
    from elastic_refit import RefitConfig

    # Six busy processes on a small (maybe shared) CPU machine: a rank can be starved for
    # seconds, so leases and timeouts are longer than the defaults (2 s lease).
    return RefitConfig(job=args["job"], role=role, member_id=member_id, layout_rank=rank,
                       etcd=(args["etcd"],), domain="train" if role == "trainer" else "serve",
                       ttl_s=6, collective_timeout_s=5.0, epoch_deadline_s=30.0)


def own_layout(model):
    """This side's whole layout, from this rank's own DTensors."""
    from elastic_refit import from_dtensors

    return from_dtensors(model).build()


def open_refit(config, model, *, serve: bool):
    from elastic_refit import ElasticRefit

    layout = own_layout(model)
    return ElasticRefit(config, layout, parameters=model) if serve else ElasticRefit(config, layout)


def layout_fingerprint(refit) -> str:
    """The fingerprint of the layout this rank described its side with (the same on every
    rank of a side: each computes it from its own DTensors' metadata)."""
    return refit.layout.fingerprint


def publish_step(refit, model, version: int) -> None:
    """Offer the trainer's local shards as ``version``; blocks until it is committed."""
    refit.publish(model, version=version)


# --- the processes ---------------------------------------------------------------------------

def trainer(rank: int, args: dict, events, proceed) -> None:
    member = f"trainer{rank}"
    try:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        setup_child()
        dtype = getattr(torch, args["dtype"])
        init_world(rank, NUM_TRAINERS, args["trainer_port"], args["timeout"])
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        model = build_model(dtype)
        apply_tp(model, mesh["tp"])
        apply_fsdp(model, mesh["dp"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        batch = train_batch(mesh["dp"].get_local_rank())
        with open_refit(refit_config(args, "trainer", member, rank), model, serve=False) as refit:
            events.put({"member": member, "type": "layout", "fingerprint": layout_fingerprint(refit)})
            for version in range(1, args["versions"] + 1):
                if version > 1 and not proceed[version - 2].wait(args["timeout"]):
                    raise TimeoutError(f"the engine did not report version {version - 1} in {args['timeout']} s")
                loss = model(input_ids=batch, labels=batch, use_cache=False).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                t0 = time.monotonic()
                publish_step(refit, model, version)
                seconds = time.monotonic() - t0
                events.put({"member": member, "type": "logits", "version": version, "seconds": seconds,
                            "loss": float(loss.detach().float()), "logits": to_bytes(probe_logits(model))})
        dist.destroy_process_group()
        events.put({"member": member, "type": "done"})
    except BaseException:
        events.put({"member": member, "type": "error", "error": traceback.format_exc(limit=8)})


def engine(rank: int, args: dict, events, proceed) -> None:
    member = f"engine{rank}"
    try:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        setup_child()
        dtype = getattr(torch, args["dtype"])
        init_world(rank, NUM_ENGINES, args["engine_port"], args["timeout"])
        mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
        model = build_model(dtype)
        apply_tp(model, mesh)
        with torch.no_grad():  # start from garbage: every element the probe reads must come from the refit
            for p in model.parameters():
                p.to_local().fill_(float("nan"))
        with open_refit(refit_config(args, "inference", member, rank), model, serve=True) as refit:
            for want in range(1, args["versions"] + 1):
                refit.wait_for_version(want, timeout_s=args["timeout"])
                with refit.weights() as version:
                    logits = probe_logits(model)
                if version != want:
                    raise RuntimeError(f"waited for version {want} but served version {version}")
                events.put({"member": member, "type": "logits", "version": version, "logits": to_bytes(logits)})
        dist.destroy_process_group()
        events.put({"member": member, "type": "done"})
    except BaseException:
        events.put({"member": member, "type": "error", "error": traceback.format_exc(limit=8)})


def setup_child() -> None:
    import warnings

    import torch

    from elastic_refit.log import configure_logging

    torch.set_num_threads(1)
    # The root module returns HF's output object, whose logits are a view; nothing here
    # modifies them in place, which is what this FSDP2 warning is about.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    configure_logging(json=True, stream=open(os.devnull, "w"))  # noqa: SIM115 - refit events are not the point here


# --- the parent: start everything, compare, report ------------------------------------------

def compare(reference, other) -> tuple[float, bool]:
    """(max abs difference, torch.equal) of two logit tensors."""
    import torch

    if reference.shape != other.shape or reference.dtype != other.dtype:
        return float("inf"), False
    diff = (reference.double() - other.double()).abs().max().item()
    return diff, bool(torch.equal(reference, other))


@dataclass
class Reports:
    """What the children reported, as the parent collects it, and every error found so far."""

    trainer_logits: dict[int, dict[str, object]] = field(default_factory=dict)  # version -> member -> logits
    engine_logits: dict[int, dict[str, object]] = field(default_factory=dict)
    publish_seconds: dict[int, float] = field(default_factory=dict)  # trainer0's, per version
    losses: dict[int, float] = field(default_factory=dict)
    fingerprints: dict[str, str] = field(default_factory=dict)  # trainer -> the layout fingerprint it computed
    errors: list[str] = field(default_factory=list)

    def record(self, e: dict, done: set[str], proceed) -> None:
        """Take in one event of a child."""
        if e["type"] == "error":
            self.errors.append(f"{e['member']} failed:\n{e['error']}")
        elif e["type"] == "done":
            done.add(e["member"])
        elif e["type"] == "layout":
            self.fingerprints[e["member"]] = e["fingerprint"]
        elif e["member"].startswith("trainer"):
            self.trainer_logits.setdefault(e["version"], {})[e["member"]] = from_bytes(e["logits"])
            if e["member"] == "trainer0":
                self.publish_seconds[e["version"]] = e["seconds"]
                self.losses[e["version"]] = e["loss"]
        else:
            self.engine_logits.setdefault(e["version"], {})[e["member"]] = from_bytes(e["logits"])
            if len(self.engine_logits[e["version"]]) == NUM_ENGINES:
                proceed[e["version"] - 1].set()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--versions", type=int, default=2)
    parser.add_argument("--etcd", default=None, help="HOST:PORT of a running etcd (default: start a local one)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before giving up on the run")
    args = parser.parse_args(argv)
    if args.versions < 1:
        parser.error(f"--versions must be >= 1, got {args.versions}")
    if not args.timeout > 0:
        parser.error(f"--timeout must be > 0, got {args.timeout}")
    if importlib.util.find_spec("transformers") is None:
        parser.error("this example needs transformers: pip install -e .[examples]")
    return args


def quiet_parent() -> None:
    """Warnings only from this process, and the clean-up of ``run_job`` on SIGTERM too."""
    from elastic_refit.log import configure_logging

    configure_logging(level=30)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def child_context():
    """A fork server that loads the children's shared imports once."""
    # The children share one set of imports (torch, elastic-refit): a fork server loads them
    # once instead of once per process (6 processes on a small machine). Importing gRPC before
    # the fork is fine; its channels are created in each child. Not transformers: Python 3.11's
    # fork server imports its preloads with the launcher's working directory on sys.path, and
    # run from the repository that puts our top-level kernels/ folder in place of the `kernels`
    # package transformers imports (5.25 and later). Each child imports it with its own path.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
                                "elastic_refit.runtime"])
    return ctx


def run_job(ctx, args: argparse.Namespace, start: float, reports: Reports) -> None:
    """Start etcd (unless given one) and the six processes, collect their reports, then stop
    whatever is left."""
    from elastic_refit.testing.etcd import EtcdServer, free_ports

    server = None
    procs: dict[str, mp.Process] = {}
    try:
        if args.etcd is None:
            server = EtcdServer(name="fsdp2-tp")
            server.start()
            endpoint = server.endpoint
        else:
            endpoint = args.etcd
        trainer_port, engine_port = free_ports(2)
        child_args = {"job": "fsdp2-tp-" + uuid.uuid4().hex[:8], "etcd": endpoint, "dtype": args.dtype,
                      "versions": args.versions, "timeout": args.timeout,
                      "trainer_port": trainer_port, "engine_port": engine_port}
        events = ctx.Queue()
        # proceed[v - 1]: every engine rank reported version v, so the trainers may train and
        # publish v + 1. Without this lockstep an engine rank could skip a version (v + 1 may
        # commit between its wait_for_version(v) and weights()), and v would go unchecked.
        proceed = [ctx.Event() for _ in range(args.versions)]
        start_processes(ctx, (child_args, events, proceed), procs)
        collect(events, procs, proceed, reports, start + args.timeout, args.timeout)
        if not reports.errors:  # every child reported done: let them exit on their own
            for p in procs.values():
                p.join(timeout=10)
    finally:
        killed = kill_survivors(procs)
        if server is not None:
            server.stop()
    if killed:
        reports.errors.append(f"killed {', '.join(killed)} (still running)")


def start_processes(ctx, shared: tuple, procs: dict[str, mp.Process]) -> None:
    """Start the trainers and the engine ranks, each into ``procs`` as soon as it runs."""
    for role, target, count in (("trainer", trainer, NUM_TRAINERS), ("engine", engine, NUM_ENGINES)):
        for rank in range(count):
            p = ctx.Process(target=target, args=(rank, *shared), daemon=True, name=f"{role}{rank}")
            p.start()
            procs[p.name] = p


def collect(events, procs: dict[str, mp.Process], proceed, reports: Reports, deadline: float,
            timeout: float) -> None:
    """Record events until every child is done, one failed, one died silently, or time is up."""
    done: set[str] = set()
    while len(done) < len(procs) and not reports.errors:
        if time.monotonic() > deadline:
            reports.errors.append(f"timed out after {timeout:.0f} s; waiting for {sorted(set(procs) - done)}")
            break
        try:
            e = events.get(timeout=0.5)
        except queue.Empty:
            dead = [n for n, p in procs.items() if n not in done and not p.is_alive()]
            if not dead:
                continue
            try:  # give an error it put just before dying a moment to arrive
                e = events.get(timeout=2.0)
            except queue.Empty:
                reports.errors.extend(f"{n} exited with code {procs[n].exitcode} without reporting" for n in dead)
                break
        reports.record(e, done, proceed)


def kill_survivors(procs: dict[str, mp.Process]) -> list[str]:
    """SIGKILL, by pid, every child still running; returns their names."""
    killed = [name for name, p in procs.items() if p.is_alive() and p.pid is not None]
    for name in killed:
        os.kill(procs[name].pid, signal.SIGKILL)
    for name in killed:
        procs[name].join(5)
    return killed


def verify(reports: Reports, args: argparse.Namespace) -> None:
    """Print the trainers' layout fingerprint and one row per version; every mismatch is an error."""
    fingerprints = reports.fingerprints
    distinct = sorted(set(fingerprints.values()))
    if len(fingerprints) != NUM_TRAINERS or len(distinct) != 1:
        reports.errors.append(f"the trainers' layout fingerprints differ or are missing: {fingerprints}")
    else:
        print(f"trainer layout fingerprint: {distinct[0]} (the same on all {NUM_TRAINERS} ranks, each from its own "
              "DTensors)")
    print(f"{'version':>7}  {'dtype':<9} {'loss':>8}  {'max abs diff':>12}  {'equal':<5}  {'publish s':>9}")
    for version in range(1, args.versions + 1):
        verify_version(reports, version, args.dtype)


def verify_version(reports: Reports, version: int, dtype: str) -> None:
    """Every trainer's and every engine rank's logits of ``version`` against trainer0's; prints its row."""
    trained = reports.trainer_logits.get(version, {})
    served = reports.engine_logits.get(version, {})
    missing = [m for m in [f"trainer{r}" for r in range(NUM_TRAINERS)] + [f"engine{r}" for r in range(NUM_ENGINES)]
               if m not in trained and m not in served]
    if missing:
        reports.errors.append(f"version {version}: no logits from {', '.join(missing)}")
        return
    reference = trained["trainer0"]
    for name, other in sorted(trained.items()):  # every trainer replica computes the same probe
        if compare(reference, other)[0] != 0:
            reports.errors.append(f"version {version}: {name}'s logits differ from trainer0's")
    results = [compare(reference, other) for _, other in sorted(served.items())]
    diffs = [r[0] for r in results]
    diff = math.nan if any(math.isnan(d) for d in diffs) else max(diffs)
    equal = all(r[1] for r in results)
    if diff != 0 or not equal:
        reports.errors.append(f"version {version}: engine logits differ from the trainer's (max abs diff {diff:g})")
    print(f"{version:>7}  {dtype:<9} {reports.losses[version]:>8.4f}  {diff:>12g}  {'yes' if equal else 'NO':<5}  "
          f"{reports.publish_seconds[version]:>9.3f}")


def report(errors: list[str], versions: int, start: float) -> int:
    """The last word, OK or every error; the exit code."""
    seconds = time.monotonic() - start
    if errors:
        print(f"FAILED after {seconds:.1f} s:", file=sys.stderr)
        for error in errors:
            print("  " + error.rstrip().replace("\n", "\n  "), file=sys.stderr)
        return 1
    print(f"OK: {versions} version(s), engine logits equal the trainer's bit for bit ({seconds:.1f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the job; 0 when every version's engine logits equal the trainers' bit for bit, else 1."""
    args = parse_args(argv)
    quiet_parent()
    start = time.monotonic()
    reports = Reports()
    run_job(child_context(), args, start, reports)  # trainers publish, the engine serves, each reports
    verify(reports, args)  # the engine's logits against the trainers', per version
    return report(reports.errors, args.versions, start)


if __name__ == "__main__":
    sys.exit(main())
