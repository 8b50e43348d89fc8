"""elastic-refit on Ray: trainer and inference ranks as Ray actors.

Each actor runs one ``ElasticRefit`` for its whole life (entered in ``__init__``), configured
from its arguments with ``RefitConfig(...)``: the job, its role, a stable member id, its rank
in its own side's layout, etcd; host and domain come from the Ray node it was placed on. Each
side describes only itself (a Megatron-style preset for trainers, a vLLM-style one for
inference); the layouts meet in etcd.

A trainer's ``step(version)`` publishes that version and returns once every live inference
rank holds it, verified. Here the weights are deterministic pattern data (what
``elastic-refit worker`` publishes); an RL framework passes its model instead. An inference
actor's ``verify(version)`` waits for that version and checks every byte it serves.

Restarts: both actors are restartable (``max_restarts``) and their methods are retried on
the restarted actor (``max_task_retries``). A restarted actor runs ``__init__`` again and so
joins as a new incarnation of the same member. The step a dead trainer had in flight is
retried by Ray on the new incarnation. That is safe because publishing is idempotent: if the
version was not committed, the new incarnation publishes the same bytes again and the job
finishes the version; if it was, ``publish`` returns the commit at once.

    python deploy/ray/refit_actors.py --trainers 2 --inference 2 --versions 6 [--kill-mid-run]

starts a local Ray cluster (or joins one: ``--address auto``) and a local etcd (or uses
``--etcd HOST:PORT``), and runs the job. ``--kill-mid-run`` SIGKILLs the last trainer while it
is sending a version; Ray restarts it and the job goes on. See README.md in this folder.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

from elastic_refit import ElasticRefit, Layout, RefitConfig
from elastic_refit.layout import megatron_layout, vllm_layout
from elastic_refit.log import configure_logging
from elastic_refit.runtime import phases
from elastic_refit.testing.faults import kill_self
from elastic_refit.testing.pattern import allocate, check_pieces, fill_pieces

SMOKE_MODEL = str(Path(__file__).resolve().parents[1] / "smoke-model.json")

# A crash, a preemption or ray.kill(actor, no_restart=False) restarts an actor at most this
# often; until then every method call in flight or queued on it is retried on the restarted
# actor. All our methods may be retried: step (publishing is idempotent), verify, status.
MAX_RESTARTS = 4
ACTOR_OPTIONS: dict[str, Any] = {
    "num_cpus": 0.25,  # trainers and engines on GPUs: .options(num_gpus=1) (device cuda:0)
    "max_restarts": MAX_RESTARTS,
    "max_task_retries": -1,
    # A threaded actor: status() answers while step() / verify() block.
    "max_concurrency": 4,
}


def node_placement(domain: str | None = None) -> tuple[str, str]:
    """(host, domain) of this actor: the Ray node's IP address, and one NVLink domain per node
    (``ray-<node id>``) unless ``domain`` names a larger one (a GB200 NVL72 rack)."""
    node_id = ray.get_runtime_context().get_node_id()
    return ray.util.get_node_ip_address(), domain or f"ray-{node_id[:12]}"


def refit_config(role: str, job: str, member_id: str, layout_rank: int, etcd: str | Sequence[str], *,
                 domain: str | None = None, backend: str = "gloo", **fields: Any) -> RefitConfig:
    """This actor's ``RefitConfig``: identity from the actor's arguments, placement from Ray.
    No incarnation is given, so every process (every restart of the actor) draws a new one."""
    host, domain = node_placement(domain)
    device = "cpu" if backend == "gloo" else "cuda:0"  # Ray shows an actor with num_gpus=1 one GPU
    return RefitConfig(job=job, role=role, member_id=member_id, layout_rank=layout_rank, etcd=etcd,
                       host=host, domain=domain, backend=backend, device=device, **fields)


class _Member:
    """What both actors have: ``config``, ``layout`` (this side's), ``refit`` (entered in
    ``__init__``, left in ``close``)."""

    config: RefitConfig
    layout: Layout
    refit: ElasticRefit

    def status(self) -> dict[str, Any]:
        """Who this actor is now: the member, its incarnation, its process, what it serves."""
        return {"member_id": self.config.member_id, "role": self.config.role,
                "incarnation": self.config.incarnation, "pid": os.getpid(),
                "restarted": ray.get_runtime_context().was_current_actor_reconstructed,
                "host": self.config.host, "domain": self.config.domain, "serving": self.refit.serving_version}

    def crash_at(self, version: int, phase: str = "transfer.before") -> None:
        """Fault injection for smoke tests: SIGKILL this process when this member reaches the
        runtime ``phase`` for ``version`` (``transfer.before``: about to move bytes), as if its
        node failed. The restarted actor is a new process: it does not crash again."""
        if phase not in phases.PHASES:
            raise ValueError(f"unknown runtime phase {phase!r}; phases are {', '.join(phases.PHASES)}")
        self._crash = (version, phase)

    def _on_phase(self, at: str, context: Any) -> None:
        """The hook this actor's context is given: the crash ``crash_at`` armed, if any."""
        crash = getattr(self, "_crash", None)
        if crash is not None and (at, context.get("version")) == (crash[1], crash[0]):
            kill_self()

    def _hooks(self) -> phases.PhaseHooks:
        return phases.PhaseHooks((self._on_phase,))

    def close(self) -> dict[str, Any]:
        """Leave the job cleanly: peers see the lease revoked at once, not after its TTL."""
        self.refit.close()
        return {**self.status(), "stats": dict(self.refit.stats)}


@ray.remote(**ACTOR_OPTIONS)
class TrainerActor(_Member):
    """One training rank: a Megatron-style shard of the model (``parallelism`` like ``tp=2``)."""

    def __init__(self, job: str, member_id: str, layout_rank: int, etcd: str | Sequence[str], *,
                 parallelism: str, model: str = SMOKE_MODEL, layers: int | None = None, **config: Any) -> None:
        configure_logging(json=True)  # JSON events on stderr: this worker's log file in Ray
        self.config = refit_config("trainer", job, member_id, layout_rank, etcd, **config)
        self.layout = megatron_layout(model, parallelism, num_layers=layers)
        self.refit = ElasticRefit(self.config, self.layout, hooks=self._hooks()).start()

    def step(self, version: int) -> dict[str, Any]:
        """Training step ``version``: publish this rank's new weights (pattern data seeded by
        the version: the same bytes on every replica and after a restart) and return once the
        version committed on every live inference rank."""
        started = time.monotonic()
        rank = self.config.layout_rank
        weights = allocate(self.layout, rank, fill=0, device=self.config.device)  # yours: the model
        fill_pieces(self.layout, rank, weights, seed=version)
        commit = self.refit.publish(weights, version)
        return {**self.status(), "version": commit.version, "epoch": commit.epoch,
                "seconds": round(time.monotonic() - started, 3)}


@ray.remote(**ACTOR_OPTIONS)
class InferenceActor(_Member):
    """One inference rank: a vLLM-style shard (``parallelism`` like ``tp=2`` or ``tp=2,dp=2``)."""

    def __init__(self, job: str, member_id: str, layout_rank: int, etcd: str | Sequence[str], *,
                 parallelism: str, model: str = SMOKE_MODEL, layers: int | None = None, **config: Any) -> None:
        configure_logging(json=True)
        self.config = refit_config("inference", job, member_id, layout_rank, etcd, **config)
        self.layout = vllm_layout(model, parallelism, num_layers=layers)
        # The engine's weights (yours: the model's parameters), written in place by each refit.
        self.params = allocate(self.layout, layout_rank, fill=0, device=self.config.device)
        self.refit = ElasticRefit(self.config, self.layout, parameters=self.params, hooks=self._hooks()).start()

    def verify(self, version: int, timeout_s: float | None = None) -> dict[str, Any]:
        """Wait until this rank serves ``version`` (or newer), then check every byte it serves
        against the pattern of the version it serves: ``problems`` is empty when all are right."""
        self.refit.wait_for_version(version, timeout_s)
        with self.refit.weights() as serving:  # an engine generates here: never a torn model
            problems = check_pieces(self.layout, self.config.layout_rank, self.params, seed=serving)
        return {**self.status(), "version": serving, "problems": problems}


# ---- the driver ----------------------------------------------------------------------------

def start_members(job: str, etcd: str | Sequence[str], *, trainers: int, inference: int,
                  train_parallelism: str | None = None, infer_parallelism: str | None = None,
                  model: str = SMOKE_MODEL, layers: int | None = None,
                  **config: Any) -> tuple[list[Any], list[Any]]:
    """Create the actors: trainer ``i`` is member ``trainer-i`` at layout rank ``i`` of a
    Megatron ``train_parallelism`` (default ``tp=<trainers>``), inference rank ``j`` is
    ``inference-j`` of a vLLM ``infer_parallelism`` (default ``tp=<inference>``). ``config``:
    more ``RefitConfig`` fields (``ttl_s``, ``collective_timeout_s``, ``backend``, ...)."""
    common = {"model": model, "layers": layers, **config}
    trainer_actors = [TrainerActor.remote(job, f"trainer-{i}", i, etcd,
                                          parallelism=train_parallelism or f"tp={trainers}", **common)
                      for i in range(trainers)]
    inference_actors = [InferenceActor.remote(job, f"inference-{j}", j, etcd,
                                              parallelism=infer_parallelism or f"tp={inference}", **common)
                        for j in range(inference)]
    return trainer_actors, inference_actors


def run_steps(trainers: Sequence[Any], inference: Sequence[Any], versions: int, *,
              crash: tuple[Any, int] | None = None, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """The RL loop's refit part, versions ``1..versions``: every trainer publishes the version
    (each ``step`` returns once it committed), then every inference rank checks what it serves.
    ``crash=(actor, version)`` kills that actor while it sends (or receives) ``version``.
    Returns one record per version: the trainers' and the inference ranks' replies."""
    records = []
    for version in range(1, versions + 1):
        if crash is not None and crash[1] == version:
            ray.get(crash[0].crash_at.remote(version))
        # A trainer that dies meanwhile is restarted by Ray, which calls step(version) again
        # on the new incarnation (max_task_retries).
        steps = ray.get([t.step.remote(version) for t in trainers], timeout=timeout_s)
        checks = ray.get([i.verify.remote(version) for i in inference], timeout=timeout_s)
        records.append({"version": version, "steps": steps, "checks": checks})
    return records


def stop_members(actors: Sequence[Any], timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Every actor leaves the job cleanly, then its process ends (and is not restarted)."""
    try:
        return ray.get([a.close.remote() for a in actors], timeout=timeout_s)
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)


def _table(records: list[dict[str, Any]]) -> str:
    lines = [f"{'version':>7}  {'epoch':>5}  {'publish s':>9}  {'trainers (incarnation)':<40}  inference"]
    for r in records:
        steps, checks = r["steps"], r["checks"]
        who = " ".join(f"{s['member_id']}({s['incarnation'][:6]})" for s in steps)
        served = " ".join(f"{c['member_id']}:{'ok' if not c['problems'] and c['version'] == r['version'] else 'WRONG'}"
                          for c in checks)
        lines.append(f"{r['version']:>7}  {steps[0]['epoch']:>5}  {max(s['seconds'] for s in steps):>9.3f}  "
                     f"{who:<40}  {served}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="elastic-refit trainers and inference ranks as Ray actors")
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--inference", type=int, default=2)
    parser.add_argument("--versions", type=int, default=6)
    parser.add_argument("--train-parallelism", help="Megatron-style, e.g. tp=2,pp=2 (default tp=<trainers>)")
    parser.add_argument("--infer-parallelism", help="vLLM-style, e.g. tp=2,dp=2 (default tp=<inference>)")
    parser.add_argument("--model", default=SMOKE_MODEL, help="model preset name or HF config.json")
    parser.add_argument("--kill-mid-run", action="store_true",
                        help="SIGKILL the last trainer while it sends the middle version")
    parser.add_argument("--address", default=None, help="an existing Ray cluster (e.g. auto); default: a local one")
    parser.add_argument("--etcd", default=None, help="HOST:PORT of the job's etcd; default: start a local one")
    parser.add_argument("--job", default=None, help="job name (default: ray-<random>)")
    parser.add_argument("--verbose", action="store_true", help="stream the actors' JSON events here")
    parser.add_argument("--json", action="store_true", help="print the records as JSON")
    args = parser.parse_args(argv)
    if min(args.trainers, args.inference, args.versions) < 1:
        parser.error("--trainers, --inference and --versions must be >= 1")

    etcd_server = None
    if args.etcd is None:  # a demo on one machine: etcd on loopback, reachable by local actors only
        from elastic_refit.testing import EtcdServer

        etcd_server = EtcdServer(name="ray").start()
    etcd = args.etcd or etcd_server.endpoint
    job = args.job or f"ray-{uuid.uuid4().hex[:6]}"
    try:
        ray.init(address=args.address, include_dashboard=False, log_to_driver=args.verbose)
        trainers, inference = start_members(job, etcd, trainers=args.trainers, inference=args.inference,
                                            train_parallelism=args.train_parallelism,
                                            infer_parallelism=args.infer_parallelism, model=args.model)
        crash = (trainers[-1], args.versions // 2 + 1) if args.kill_mid_run else None
        records = run_steps(trainers, inference, args.versions, crash=crash)
        stop_members(trainers + inference)
    finally:
        ray.shutdown()
        if etcd_server is not None:
            etcd_server.stop()
    print(json.dumps(records, indent=1) if args.json else _table(records))
    wrong = [c for r in records for c in r["checks"] if c["problems"] or c["version"] != r["version"]]
    for c in wrong:
        print(f"error: {c['member_id']} version {c['version']}: {c['problems'][:1]}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
