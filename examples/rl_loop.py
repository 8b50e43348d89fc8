"""A tiny RL loop on elastic-refit: a trainer improves a policy with REINFORCE and publishes
each version; inference ranks act with the committed weights between refits.

    python examples/rl_loop.py [--versions 5] [--inference 2]

Starts its own etcd on loopback; CPU and gloo; finishes in well under a minute. The policy
is a small MLP (torch modules). Each side describes only itself, from its own module: the
trainer holds every parameter whole (``from_dtensors(policy, plain_ranks=[0])``), the actors
are replicas (``plain_ranks=range(num_actors)``), and the runtime plans the refit from the two
layouts in etcd. The trainer publishes the module as is and each actor receives straight
into its own module's parameters.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import signal
import sys
import time

OBS, HIDDEN, ACTIONS = 8, 32, 4


def make_policy():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(OBS, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, ACTIONS))


def env_batch(n: int, generator):
    """A contextual bandit: the rewarded action is the argmax of the first ACTIONS features."""
    import torch

    obs = torch.randn(n, OBS, generator=generator)
    return obs, obs[:, :ACTIONS].argmax(dim=1)


def member(role: str, member_id: str, rank: int, etcd: str, job: str, versions: int, events) -> None:
    import torch

    from elastic_refit import ElasticRefit, RefitConfig, from_dtensors
    from elastic_refit.log import configure_logging

    torch.set_num_threads(1)
    configure_logging(json=True, stream=open(os.devnull, "w"))  # noqa: SIM115 - events are not the point here
    config = RefitConfig(job=job, role=role, member_id=member_id, layout_rank=rank, etcd=(etcd,),
                         domain="train" if role == "trainer" else "serve")
    policy = make_policy()
    # This side's layout, from its own module: one trainer, or num_actors replicas.
    num_ranks = 1 if role == "trainer" else int(os.environ["RL_NUM_INFERENCE"])
    layout = from_dtensors(policy, plain_ranks=range(num_ranks)).build()
    generator = torch.Generator().manual_seed(rank)
    torch.manual_seed(100 + rank)  # action sampling
    try:
        if role == "trainer":
            opt = torch.optim.Adam(policy.parameters(), lr=0.05)
            with ElasticRefit(config, layout) as refit:
                for version in range(1, versions + 1):
                    for _ in range(10):  # REINFORCE with a mean baseline
                        obs, best = env_batch(256, generator)
                        dist = torch.distributions.Categorical(logits=policy(obs))
                        action = dist.sample()
                        reward = (action == best).float()
                        loss = -((reward - reward.mean()) * dist.log_prob(action)).mean()
                        opt.zero_grad()
                        loss.backward()
                        opt.step()
                    commit = refit.publish(policy, version)
                    events.put({"member": member_id, "type": "published", "version": version,
                                "epoch": commit.epoch, "train_reward": float(reward.mean())})
            return
        with torch.no_grad(), ElasticRefit(config, layout, parameters=policy) as refit:
            seen = 0
            while seen < versions:
                refit.wait_for_version(seen + 1, timeout_s=60)
                with refit.weights() as version:  # parameters hold still while we act
                    obs, best = env_batch(512, generator)
                    action = torch.distributions.Categorical(logits=policy(obs)).sample()
                    reward = float((action == best).float().mean())
                events.put({"member": member_id, "type": "acted", "version": version, "reward": reward})
                seen = version
    except BaseException as exc:
        events.put({"member": member_id, "type": "error", "error": f"{type(exc).__name__}: {exc}"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--inference", type=int, default=2)
    args = parser.parse_args(argv)
    if args.versions < 1 or args.inference < 1:
        raise SystemExit("--versions and --inference must be >= 1")
    from elastic_refit.log import configure_logging
    from elastic_refit.testing import EtcdServer

    configure_logging(level=30)  # warnings only from this process
    os.environ["RL_NUM_INFERENCE"] = str(args.inference)  # inherited by the spawned members
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    server = EtcdServer(name="rl-loop")
    server.start()
    procs = []
    start = time.monotonic()
    result = {"versions": [], "inference": {}, "errors": []}
    try:
        roles = [("trainer", "trainer", 0)] + [("inference", f"actor{k}", k) for k in range(args.inference)]
        for role, member_id, rank in roles:
            p = ctx.Process(target=member, args=(role, member_id, rank, server.endpoint, "rl-loop", args.versions,
                                                 events), daemon=True)
            p.start()
            procs.append(p)
        done = set()
        deadline = time.monotonic() + 90
        while len(done) < len(procs) and time.monotonic() < deadline:
            try:
                e = events.get(timeout=0.5)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            t = time.monotonic() - start
            if e["type"] == "published":
                result["versions"].append(e["version"])
                print(f"[{t:5.1f}s] trainer: version {e['version']} committed (epoch {e['epoch']}), "
                      f"train reward {e['train_reward']:.2f}", flush=True)
                if e["version"] == args.versions:
                    done.add(e["member"])
            elif e["type"] == "acted":
                result["inference"].setdefault(e["member"], []).append(e["version"])
                print(f"[{t:5.1f}s] {e['member']}: acting with version {e['version']}, reward {e['reward']:.2f}",
                      flush=True)
                if e["version"] == args.versions:
                    done.add(e["member"])
            else:
                result["errors"].append(f"{e['member']}: {e['error']}")
                print(f"[{t:5.1f}s] {e['member']} failed: {e['error']}", file=sys.stderr, flush=True)
                done.add(e["member"])
                if e["member"] == "trainer":
                    break  # nothing more will commit
        for p in procs:
            p.join(timeout=15)
    finally:
        for p in procs:  # stop what is left by pid
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)
        server.stop()
    ok = (result["versions"] == list(range(1, args.versions + 1)) and not result["errors"]
          and all(v[-1] == args.versions for v in result["inference"].values())
          and len(result["inference"]) == args.inference)
    print("RESULT " + json.dumps(dict(result, ok=ok, seconds=round(time.monotonic() - start, 2))), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
