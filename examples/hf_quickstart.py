"""The smallest honest integration: a Hugging Face model, one trainer, two inference engines.

    elastic-refit etcd &                       # a local etcd; prints the line below
    export ELASTIC_REFIT_ETCD=127.0.0.1:2379
    python examples/hf_quickstart.py [--steps 3] [--job quickstart] [--engine-dtype bfloat16]

A small Qwen3 (2 layers, built from a config: no download) in three processes on this
machine (CPU, gloo): a trainer that takes an AdamW step and publishes the weights as a new
version after every step, and two inference processes ("engines") that serve whatever version
is committed. Each process describes only its own side (``from_dtensors(model, plain_ranks=...)``:
here every rank holds the whole model) and reads the job's settings from ``ELASTIC_REFIT_*``
variables (``RefitConfig.from_env()``), as processes of a real job would. Every engine computes a
probe's next token under ``refit.weights()``, tags it with the version it served, and reports a
digest of its parameters; this script checks that each digest equals the trainer's for that
version, and exits 1 otherwise. ``--engine-dtype bfloat16``: the engines hold the model in
bfloat16 while the trainer keeps float32; the trainer publishes its float32 weights as they are
and each sender casts on the way (the engines' digests are then checked against the trainer's
weights ``.to(bfloat16)``). Needs ``transformers`` (``pip install -e .[examples]``).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import time

NUM_ENGINES = 2


def build_model():
    """The user's model: the same Qwen3 (same seed) in every process, float32 on CPU."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def weights_digest(model, dtype=None) -> str:
    """sha256 over every parameter's bytes (cast to ``dtype`` first, if given), in name order:
    equal digests, equal weights."""
    import torch

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().to(dtype or p.dtype).contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


def trainer(steps: int, engine_dtype: str, stop, events) -> None:
    import torch

    from elastic_refit import ElasticRefit, RefitConfig, from_dtensors

    model = build_model()
    layout = from_dtensors(model, plain_ranks=[0]).build()  # one trainer rank holds everything
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    with ElasticRefit(RefitConfig.from_env(), layout) as refit:
        events.put(("trainer", None, {"joined": True}))
        for step in range(1, steps + 1):
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                digest = weights_digest(model, getattr(torch, engine_dtype))  # what the engines must hold
                commit = refit.publish(model, version=step)  # blocks until every engine holds it, verified
            events.put(("trainer", step, {"loss": loss.item(), "epoch": commit.epoch, "digest": digest}))
        while not stop.is_set():  # stay in the job until every engine holds the last version
            time.sleep(0.1)


def engine(rank: int, steps: int, engine_dtype: str, stop, events) -> None:
    import torch

    from elastic_refit import ElasticRefit, RefitConfig, RefitTimeout, from_dtensors

    model = build_model().to(getattr(torch, engine_dtype))  # a float32 trainer's weights are cast on the way
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # every element served must come through the refit
    layout = from_dtensors(model, plain_ranks=range(NUM_ENGINES)).build()  # replicas: each holds everything
    probe = torch.arange(8).unsqueeze(0)
    with torch.no_grad(), ElasticRefit(RefitConfig.from_env(), layout, parameters=model) as refit:
        events.put((f"engine{rank}", None, {"joined": True}))
        served = 0
        while not stop.is_set():  # an engine serves until it is told to stop
            try:
                refit.wait_for_version(served + 1, timeout_s=0.5)
            except RefitTimeout:
                continue  # no newer version yet
            with refit.weights() as version:  # the weights hold still, whole, at `version`
                token = int(model(input_ids=probe).logits[0, -1].argmax())  # a sample, tagged with its version
                digest = weights_digest(model)
            events.put((f"engine{rank}", version, {"token": token, "digest": digest}))
            served = version


def _member(target, env: dict[str, str], args: tuple) -> None:
    """A process of the job: its own ELASTIC_REFIT_* variables, quiet logs, then its role."""
    os.environ.update(env)
    import torch

    from elastic_refit.log import configure_logging

    torch.set_num_threads(1)
    configure_logging(level=30)  # warnings only, to stderr
    events = args[-1]
    try:
        target(*args)
    except BaseException as exc:
        events.put((env["ELASTIC_REFIT_MEMBER_ID"], None, {"error": f"{type(exc).__name__}: {exc}"}))


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, str]:
    """The command line, and the etcd endpoint from ``ELASTIC_REFIT_ETCD``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps, one version each (default 3)")
    parser.add_argument("--job", default="quickstart", help="job name in etcd (default quickstart)")
    parser.add_argument("--engine-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the engines' dtype (default float32); bfloat16: the float32 trainer's weights "
                             "are cast by its senders on the way")
    args = parser.parse_args(argv)
    etcd = os.environ.get("ELASTIC_REFIT_ETCD")
    if not etcd:
        parser.error("ELASTIC_REFIT_ETCD is not set: start a local etcd with `elastic-refit etcd` and export "
                     "the line it prints")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    return args, etcd


def job_members(args: argparse.Namespace, etcd: str) -> list[tuple]:
    """(role function, its ELASTIC_REFIT_* variables, its arguments) of each process of the job."""
    common = {"ELASTIC_REFIT_JOB": args.job, "ELASTIC_REFIT_ETCD": etcd}
    members = [(trainer, {**common, "ELASTIC_REFIT_ROLE": "trainer", "ELASTIC_REFIT_MEMBER_ID": "trainer",
                          "ELASTIC_REFIT_LAYOUT_RANK": "0", "ELASTIC_REFIT_DOMAIN": "training-node"},
                (args.steps, args.engine_dtype))]
    members += [(engine, {**common, "ELASTIC_REFIT_ROLE": "inference", "ELASTIC_REFIT_MEMBER_ID": f"engine{k}",
                          "ELASTIC_REFIT_LAYOUT_RANK": str(k), "ELASTIC_REFIT_DOMAIN": "inference-node"},
                 (k, args.steps, args.engine_dtype)) for k in range(NUM_ENGINES)]
    return members


def print_banner(args: argparse.Namespace, etcd: str) -> None:
    """One line on the job: where it runs, the model, the members."""
    model = build_model()
    num_params = sum(p.numel() for p in model.parameters())
    print(f"job {args.job} on etcd {etcd}: Qwen3 from a config ({model.config.num_hidden_layers} layers, "
          f"{num_params / 1e6:.2f} M parameters, float32), 1 trainer, {NUM_ENGINES} engines"
          + ("" if args.engine_dtype == "float32" else f" in {args.engine_dtype}"), flush=True)


def run_job(args: argparse.Namespace, etcd: str) -> tuple[dict[int, str], dict[str, dict[int, str]], list[str]]:
    """Start the trainer and the engines, watch them until every engine served the last version,
    then stop them; returns what ``watch`` saw."""
    ctx = mp.get_context("spawn")  # gRPC channels do not survive fork()
    events, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_member, args=(target, env, (*extra, stop, events)), daemon=True)
             for target, env, extra in job_members(args, etcd)]
    start = time.monotonic()
    try:
        for p in procs:
            p.start()
        trained, served, errors = watch(args, procs, events, start)
        stop.set()
        for p in procs:
            p.join(timeout=15)
    finally:
        for p in procs:  # whatever is left, by pid
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)
    return trained, served, errors


def watch(args: argparse.Namespace, procs: list, events, start: float) -> tuple[dict, dict, list[str]]:
    """Print the members' events as they come until the end (or an error): the digests the trainer
    published per version, those each engine served per version, and the errors."""
    trained: dict[int, str] = {}
    served: dict[str, dict[int, str]] = {f"engine{k}": {} for k in range(NUM_ENGINES)}
    errors: list[str] = []
    deadline = time.monotonic() + 120 + 10 * args.steps
    trained_at = None  # when the trainer's last version committed
    while (len(trained) < args.steps or any(args.steps not in s for s in served.values())) and not errors:
        if time.monotonic() > deadline:
            errors.append("timed out")
            break
        if trained_at is not None and not any(served.values()) and time.monotonic() - trained_at > 30:
            # versions only move forward: a job name that ran before on this etcd has these
            # versions committed already, and there is nothing new to send the engines
            errors.append(f"every version committed but no engine received one: did job {args.job!r} run "
                          f"before on this etcd? Pass another --job")
            break
        try:
            who, version, data = events.get(timeout=0.5)
        except queue.Empty:
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            if failed:
                errors.append(f"{len(failed)} process(es) died (exit status {failed[0].exitcode})")
            continue
        t = time.monotonic() - start
        if "error" in data:
            errors.append(f"{who}: {data['error']}")
        elif "joined" in data:  # start-up (imports, the model, joining the job in etcd) is over
            print(f"[{t:5.1f}s] {who}: joined the job", flush=True)
        elif who == "trainer":
            trained[version] = data["digest"]
            trained_at = time.monotonic() if len(trained) == args.steps else None
            print(f"[{t:5.1f}s] trainer: step {version}, loss {data['loss']:.3f}; version {version} committed",
                  flush=True)
        else:
            served[who][version] = data["digest"]
            print(f"[{t:5.1f}s] {who}: serving version {version}, next token {data['token']}", flush=True)
    return trained, served, errors


def check_digests(trained: dict[int, str], served: dict[str, dict[int, str]]) -> list[str]:
    """An error for every version an engine served whose weights differ from the trainer's."""
    return [f"{who}: version {version}'s weights differ from the trainer's"
            for who, versions in served.items() for version, digest in sorted(versions.items())
            if trained.get(version) != digest]


def main(argv: list[str] | None = None) -> int:
    """Run the job; 0 when every version an engine served equals the trainer's, bit for bit, else 1."""
    args, etcd = parse_args(argv)
    print_banner(args, etcd)
    trained, served, errors = run_job(args, etcd)  # the trainer publishes, the engines serve
    errors += check_digests(trained, served)
    if errors:
        print("FAILED: " + "; ".join(errors), file=sys.stderr, flush=True)
        return 1
    checked = sum(len(v) for v in served.values())
    cast = "" if args.engine_dtype == "float32" else f" cast to {args.engine_dtype}"
    print(f"OK: {args.steps} versions committed; {checked} served versions checked, every engine's weights equal "
          f"the trainer's{cast} bit for bit", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
