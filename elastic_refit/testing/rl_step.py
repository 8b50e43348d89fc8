"""One RL loop around the refit, as real processes: the members' side.

Trainers (``num_trainers`` processes; FSDP2 when more than one) improve a Hugging Face
Qwen3 built from a config (random weights, nothing downloaded) with a GRPO-style loss on
synthetic rewards; inference processes ("engines", full replicas) sample completions with
Hugging Face ``generate`` and send them, tagged with the version they were generated with,
to the trainers. The weights move after every step, in one of three modes:

- ``sync-gather``: the baseline, plain torch.distributed: every trainer gathers the full
  tensors, trainer 0 broadcasts each to every engine, which writes it in place; nobody
  generates meanwhile;
- ``sync-reshard``: ``ElasticRefit`` in place, ``publish`` blocks until committed; the
  engines wait for the version, then generate;
- ``async-staged``: ``ElasticRefit`` staged, ``publish(wait=False)`` one step ahead (a
  trainer waits for version k - ``staleness`` before publishing k + 1); the engines generate
  all the time and switch versions between ``weights()`` blocks; trainers drop samples
  older than the bound.

Every served version's weights are checked against the trainers' (a checksum of the bits,
additive over FSDP shards). Each process writes its JSON log to ``log_dir`` (one file per
incarnation: ``elastic-refit timeline`` reads them) and reports records on a queue; the
parent (``testing.rl_run``) kills and restarts an engine in the asynchronous mode.

Samples, records and "mode over" flags pass through files in ``run_dir`` (a batch is
written aside and renamed into place; a record is one append of one line): a process
SIGKILLed mid-write leaves at most a partial line or a stray temporary file, where a pipe
shared with it (a multiprocessing queue) could be left corrupt for every reader.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic_refit.testing.cpu_sampler import CpuSampler
from elastic_refit.testing.rl_model import TINY_QWEN3, build_model, checksum, grpo_loss, reward

__all__ = ["MODES", "RLStepConfig", "member_main"]

MODES = ("sync-gather", "sync-reshard", "async-staged")



@dataclass(frozen=True, slots=True)
class RLStepConfig:
    """What one run of the loop does (the same in every process)."""

    job: str
    etcd: str
    log_dir: str
    run_dir: str  # samples, records, flags (see the module's docstring)
    port: int  # the torch.distributed world's rendezvous (trainers + engines)
    device: str = "cpu"  # cpu | cuda
    backend: str = "gloo"  # the refit's transport: gloo | nccl | nccl4py
    model: tuple[tuple[str, Any], ...] = TINY_QWEN3  # Qwen3Config keywords
    dtype: str = "float32"
    num_trainers: int = 1
    num_inference: int = 2
    steps: int = 3
    prompts: int = 2  # prompts per generate call of one engine
    group: int = 4  # completions per prompt (the GRPO group)
    prompt_len: int = 8
    new_tokens: int = 8
    modes: tuple[str, ...] = MODES
    kill_at: int | None = None  # async step during whose refit the last engine is SIGKILLed (then restarted)
    staleness: int = 1
    lr: float = 1e-4
    seed: int = 0
    refit: tuple[tuple[str, Any], ...] = ()  # extra RefitConfig keywords (timeouts)
    env: tuple[tuple[str, str], ...] = field(default=())  # per-run environment of every member
    # The engines' CPU samples (rl_run's "cpu"): at 0.1 s their /proc reads held an engine's
    # GIL ~1.8% of the time (py-spy, H100), a load on what they measure; GPU refits last ~1 s.
    cpu_interval_s: float = 0.25

    def __post_init__(self) -> None:
        if not set(self.modes) <= set(MODES) or not self.modes:
            raise ValueError(f"modes must be among {MODES}, got {self.modes}")
        if self.num_trainers < 1 or self.num_inference < 1 or self.num_inference % self.num_trainers:
            raise ValueError(f"num_inference ({self.num_inference}) must be a multiple of num_trainers "
                             f"({self.num_trainers}), both >= 1")
        if self.kill_at is not None and ("async-staged" not in self.modes or not 2 <= self.kill_at <= self.steps
                                         or self.num_inference < 2):
            raise ValueError(f"kill_at must be a step in 2..{self.steps} of the async mode with >= 2 engines, "
                             f"got {self.kill_at}")
        if not self.cpu_interval_s > 0:
            raise ValueError(f"cpu_interval_s must be > 0, got {self.cpu_interval_s}")

    @property
    def world_size(self) -> int:
        return self.num_trainers + self.num_inference

    @property
    def batches_per_step(self) -> int:
        """Generate calls' batches one trainer takes per step."""
        return self.num_inference // self.num_trainers


# ---- a member process ----------------------------------------------------------------------

@dataclass
class _Member:
    config: RLStepConfig
    role: str
    rank: int  # within its side
    incarnation: str = ""
    device: Any = None
    groups: dict[str, Any] = field(default_factory=dict)
    trace: Any = None  # a structlog logger: the loop's phases as events with seconds (slices in the timeline)
    _sent: int = 0

    @property
    def member_id(self) -> str:
        return f"t{self.rank}" if self.role == "trainer" else f"i{self.rank}"

    @property
    def global_rank(self) -> int:
        return self.rank if self.role == "trainer" else self.config.num_trainers + self.rank

    def report(self, kind: str, **fields: Any) -> None:
        """One record to the parent: one append of one line to this incarnation's file."""
        line = json.dumps({"kind": kind, "member": self.member_id, "role": self.role, "t": time.time(),
                           "incarnation": self.incarnation, **fields}) + "\n"
        fd = os.open(os.path.join(self.config.run_dir, f"{self.incarnation}.jsonl"),
                     os.O_CREAT | os.O_APPEND | os.O_WRONLY, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def send(self, trainer: int, batch: dict[str, Any]) -> None:
        """A batch of samples to ``trainer``: written aside, renamed into place."""
        import torch

        folder = os.path.join(self.config.run_dir, f"samples-t{trainer}")
        os.makedirs(folder, exist_ok=True)
        self._sent += 1
        name = f"{time.time():.6f}-{self.incarnation}-{self._sent}.pt"
        torch.save(batch, os.path.join(folder, "." + name))
        os.rename(os.path.join(folder, "." + name), os.path.join(folder, name))

    def over(self, mode: str) -> bool:
        return os.path.exists(os.path.join(self.config.run_dir, f"over-{mode}"))

    def wait_over(self, mode: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.over(mode) and time.monotonic() < deadline:
            time.sleep(0.05)


def _unshadow_kernels() -> None:
    """Drop a source checkout of this repository from the path (a test runner puts it there,
    and spawned processes inherit it): its top-level ``kernels/`` folder would shadow the
    ``kernels`` package transformers imports. The installed package needs no checkout."""
    import sys

    def shadows(entry: str) -> bool:
        root = entry or os.getcwd()
        return os.path.isfile(os.path.join(root, "kernels", "__init__.py")) and os.path.isdir(
            os.path.join(root, "elastic_refit"))

    sys.path[:] = [entry for entry in sys.path if not shadows(entry)]


def member_main(config: RLStepConfig, role: str, rank: int, env: dict[str, str], restarted: bool = False) -> None:
    """A process of the loop: set up (environment, log file, world), then every mode."""
    os.environ.update(env)
    _unshadow_kernels()
    import torch

    from elastic_refit.log import configure_logging

    m = _Member(config, role, rank, incarnation=f"{'t' if role == 'trainer' else 'i'}{rank}"
                f"-{'R' if restarted else 'L'}-{uuid.uuid4().hex[:6]}")
    torch.set_num_threads(2 if config.device == "cpu" else 4)
    log = open(os.path.join(config.log_dir, f"{m.incarnation}.log"), "a")  # noqa: SIM115 - the process's log
    configure_logging(json=True, stream=log)
    m.device = torch.device("cpu") if config.device == "cpu" else torch.device("cuda", int(env.get(
        "ELASTIC_REFIT_CUDA_DEVICE", "0")))
    if m.device.type == "cuda":
        torch.cuda.set_device(m.device)
    from elastic_refit.log import get_logger

    m.trace = get_logger("rl", member_id=m.member_id, role=role, incarnation=m.incarnation)
    m.report("started", restarted=restarted)
    try:
        if restarted:  # out of the torch.distributed world (it cannot take a newcomer): the async mode only
            _serve_async(m)
        else:
            _join_world(m)
            for mode in config.modes:
                torch.distributed.barrier()
                m.report("mode.started", mode=mode)
                (_train if role == "trainer" else _serve)[mode](m)
                m.report("mode.done", mode=mode)
    except BaseException as exc:
        import traceback

        m.report("error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
        raise
    finally:
        log.flush()
    m.report("exited")


def _join_world(m: _Member) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    c = m.config
    dist.init_process_group("nccl" if m.device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{c.port}",
                            rank=m.global_rank, world_size=c.world_size, timeout=timedelta(seconds=120),
                            **({"device_id": m.device} if m.device.type == "cuda" else {}))
    # Every rank makes every group, in the same order.
    m.groups["trainers"] = dist.new_group(list(range(c.num_trainers)))
    m.groups["broadcast"] = dist.new_group([0, *range(c.num_trainers, c.world_size)])


def _refit_config(m: _Member, mode: str, **more: Any):
    from elastic_refit import RefitConfig

    c = m.config
    device = "cpu" if m.device.type == "cpu" else f"cuda:{m.device.index}"
    extra = {**dict(c.refit), **more}
    if mode == "async-staged":
        extra.setdefault("mode", "staged")
    return RefitConfig(job=f"{c.job}-{mode}", role=m.role, member_id=m.member_id, layout_rank=m.rank,
                       etcd=(c.etcd,), domain="train" if m.role == "trainer" else f"serve-{m.rank}",
                       device=device, backend=c.backend, incarnation=m.incarnation, **extra)


# ---- trainers --------------------------------------------------------------------------------

def _trainer_model(m: _Member):
    """The policy, FSDP2-sharded over the trainers when there are several; its optimizer."""
    import torch

    model = build_model(m.config, m.device)
    if m.config.num_trainers > 1:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(m.groups["trainers"], m.device.type)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=m.config.lr)


def _local(model) -> dict:
    from elastic_refit.runtime.checks import tensors_of

    return tensors_of(model)


def _trainer_checksum(m: _Member, model) -> list[int]:
    import torch
    import torch.distributed as dist

    sums = torch.tensor(checksum(_local(model)), dtype=torch.int64, device=m.device)
    if m.config.num_trainers > 1:
        dist.all_reduce(sums, group=m.groups["trainers"])
    return sums.tolist()


def _take(m: _Member, step: int, fresh: Callable[[int], bool]) -> list[dict[str, Any]]:
    """This trainer's batches of ``step``, oldest first (``fresh(version)``: usable; the
    others are dropped, as an off-policy bound would)."""
    import torch

    folder = os.path.join(m.config.run_dir, f"samples-t{m.rank}")
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + 600
    while len(out) < m.config.batches_per_step:
        names = sorted(n for n in os.listdir(folder) if not n.startswith(".")) if os.path.isdir(folder) else []
        if not names:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{m.member_id}: no samples for step {step}")
            time.sleep(0.005)
            continue
        path = os.path.join(folder, names[0])
        batch = torch.load(path, weights_only=True)
        os.unlink(path)
        if fresh(batch["version"]):
            out.append(batch)
    return out


def _train_step(m: _Member, model, opt, step: int, fresh: Callable[[int], bool]) -> dict[str, Any]:
    import torch

    t0 = time.time()
    batches = _take(m, step, fresh)
    t1 = time.time()
    loss, mean_reward = grpo_loss(model, batches, m.config.prompt_len, m.config.group)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if m.device.type == "cuda":
        torch.cuda.synchronize()
    m.trace.info("rl.train", step=step, seconds=time.time() - t1, loss=float(loss.detach()))
    return {"wait_samples_s": t1 - t0, "train_s": time.time() - t1, "train_start": t1, "train_end": time.time(),
            "loss": float(loss.detach()), "reward": mean_reward, "sample_versions": sorted({b["version"] for b in batches})}


def _train_gather(m: _Member) -> None:
    model, opt = _trainer_model(m)
    _gather_broadcast(m, model, 0, _trainer_checksum(m, model))
    for step in range(1, m.config.steps + 1):
        record = _train_step(m, model, opt, step, lambda v, s=step: v == s - 1)
        total = _trainer_checksum(m, model)  # (before the clock: the check is not part of the refit)
        t0 = time.time()
        _gather_broadcast(m, model, step, total)
        record.update(refit_s=time.time() - t0, refit_start=t0, refit_end=time.time())
        m.trace.info("rl.gather_broadcast", version=step, seconds=record["refit_s"])
        m.report("step", mode="sync-gather", step=step, **record)


def _gather_broadcast(m: _Member, model, version: int, total: list[int]) -> None:
    """The baseline: every tensor gathered whole on every trainer, broadcast by trainer 0."""
    import torch
    import torch.distributed as dist

    t0 = time.time()
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            if m.rank == 0:
                dist.broadcast(full.contiguous(), src=0, group=m.groups["broadcast"])
    if m.device.type == "cuda":
        torch.cuda.synchronize()
    if m.rank == 0:
        m.report("published", mode="sync-gather", version=version, checksum=total, start=t0, end=time.time())


def _train_elastic(m: _Member, mode: str) -> None:
    from elastic_refit import ElasticRefit, from_dtensors

    model, opt = _trainer_model(m)
    c = m.config
    layout = from_dtensors(model, plain_ranks=[0]).build() if c.num_trainers == 1 else from_dtensors(model).build()
    nbytes = sum(t.numel() * t.element_size() for t in _local(model).values())
    # Async: publish copies the tensors (within the snapshot budget) and returns at once.
    config = _refit_config(m, mode, **({"snapshot_bytes": (c.staleness + 1) * nbytes} if mode == "async-staged"
                                        else {}))
    with ElasticRefit(config, layout) as refit:
        _publish(m, refit, model, 0, mode, _trainer_checksum(m, model), wait=True)
        handles: deque = deque()
        for step in range(1, c.steps + 1):
            fresh = (lambda v, s=step: v == s - 1) if mode == "sync-reshard" else \
                (lambda v, s=step: v >= s - 1 - c.staleness)
            record = _train_step(m, model, opt, step, fresh)
            total = _trainer_checksum(m, model)  # (before the clock: the check is not part of the refit)
            t0 = time.time()
            if mode == "sync-reshard":
                _publish(m, refit, model, step, mode, total, wait=True)
            else:
                handles.append(_publish(m, refit, model, step, mode, total, wait=False))
                while len(handles) > c.staleness:  # bounded staleness: k - staleness committed first
                    handles.popleft().wait()
            record.update(refit_s=time.time() - t0, refit_start=t0, refit_end=time.time())
            m.trace.info("rl.publish", version=step, seconds=record["refit_s"], mode=mode)
            m.report("step", mode=mode, step=step, **record)
        while handles:
            handles.popleft().wait()
        m.report("trained", mode=mode)
        m.wait_over(mode)  # the engines are done: leave together (no needless epoch)


def _publish(m: _Member, refit, model, version: int, mode: str, total: list[int], *, wait: bool):
    t0 = time.time()
    handle = refit.publish(model, version, wait=wait)
    if m.rank == 0:
        m.report("published", mode=mode, version=version, checksum=total, start=t0, end=time.time())
    return handle


_train = {"sync-gather": _train_gather,
          "sync-reshard": lambda m: _train_elastic(m, "sync-reshard"),
          "async-staged": lambda m: _train_elastic(m, "async-staged")}


# ---- engines ---------------------------------------------------------------------------------

class _StepClock:
    """A logits processor that only notes the time of every decode step (tokens/s over time)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.time())
        return scores


def _engine_model(m: _Member):
    import torch

    model = build_model(m.config, m.device).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # every element served must come through the refit
    return model


def _generate(m: _Member, model, version: int, seen: set[int], mode: str, batch_index: int, trainer: int) -> None:
    """One generate call on the served weights (inside ``weights()`` for the elastic modes):
    the batch goes to a trainer, tagged with ``version``; a version seen for the first time
    is checked."""
    import torch

    c = m.config
    version = int(version)  # weights() yields a ServedVersion: the samples' file holds plain data
    if version not in seen:
        seen.add(version)
        m.report("served", mode=mode, version=version, checksum=checksum(dict(model.named_parameters())))
    g = torch.Generator(device="cpu").manual_seed(c.seed * 7919 + m.rank * 104729 + batch_index)
    vocab = dict(c.model)["vocab_size"]
    prompts = torch.randint(1, vocab, (c.prompts, c.prompt_len), generator=g)
    prompts = prompts.repeat_interleave(c.group, dim=0).to(m.device)
    clock = _StepClock()
    t0 = time.time()
    with torch.no_grad():
        out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                             max_new_tokens=c.new_tokens, min_new_tokens=c.new_tokens,
                             logits_processor=[clock], pad_token_id=0)
    t1 = time.time()
    m.trace.info("rl.generate", version=version, seconds=t1 - t0, mode=mode, num_sequences=len(out))
    tokens = out.cpu()
    m.send(trainer, {"version": version, "tokens": tokens, "rewards": reward(tokens[:, c.prompt_len:], vocab)})
    m.report("generated", mode=mode, version=version, start=t0, end=t1, num_sequences=len(tokens),
             step_times=clock.times)


def _serve_gather(m: _Member) -> None:
    import torch
    import torch.distributed as dist

    model, seen = _engine_model(m), set()
    for version in range(0, m.config.steps + 1):
        t0 = time.time()
        with torch.no_grad():
            for _, p in sorted(model.named_parameters()):
                dist.broadcast(p.data, src=0, group=m.groups["broadcast"])
        if m.device.type == "cuda":
            torch.cuda.synchronize()  # NCCL only enqueued the receives: received is when they ran
        m.report("received", mode="sync-gather", version=version, start=t0, end=time.time())
        if version < m.config.steps:
            _generate(m, model, version, seen, "sync-gather", version, m.rank % m.config.num_trainers)


def _serve_reshard(m: _Member) -> None:
    from elastic_refit import ElasticRefit, from_dtensors

    model, seen = _engine_model(m), set()
    layout = from_dtensors(model, plain_ranks=range(m.config.num_inference)).build()
    with ElasticRefit(_refit_config(m, "sync-reshard"), layout, parameters=model) as refit:
        for version in range(0, m.config.steps):
            t0 = time.time()
            refit.wait_for_version(version)
            m.report("received", mode="sync-reshard", version=version, start=t0, end=time.time())
            with refit.weights() as served:
                _generate(m, model, served, seen, "sync-reshard", version, m.rank % m.config.num_trainers)
        refit.wait_for_version(m.config.steps)
        m.report("received", mode="sync-reshard", version=m.config.steps, start=time.time(), end=time.time())
        m.wait_over("sync-reshard")


def _serve_async(m: _Member) -> None:
    from elastic_refit import ElasticRefit, from_dtensors

    model, seen = _engine_model(m), set()
    layout = from_dtensors(model, plain_ranks=range(m.config.num_inference)).build()

    def on_event(name: str, fields: dict[str, Any]) -> None:
        if name in ("refit.transfer.done", "refit.serving.paused"):
            m.report("refit.event", mode="async-staged", event=name, version=fields.get("version"),
                     seconds=fields.get("seconds"), at=time.time())

    # The host's and this engine's threads' CPU beside its refit windows (rl_run's "cpu").
    sampler = CpuSampler(lambda sample: m.report("cpu", mode="async-staged", **sample),
                         interval_s=m.config.cpu_interval_s)
    with sampler, ElasticRefit(_refit_config(m, "async-staged"), layout, parameters=model,
                               on_event=on_event) as refit:
        m.report("joined", mode="async-staged")
        refit.wait_for_version(None, timeout_s=120)
        count = 0
        while not m.over("async-staged"):
            with refit.weights() as version:  # held through the whole generate: never torn
                # Round robin over the trainers: a lost engine starves none of them.
                _generate(m, model, version, seen, "async-staged", count, (m.rank + count) % m.config.num_trainers)
            count += 1


_serve = {"sync-gather": _serve_gather, "sync-reshard": _serve_reshard, "async-staged": _serve_async}
