"""A deterministic fault fails its version everywhere, fast, and later versions still commit.

Real etcd, real gloo communicators; the members run in this process, one thread each (the
runtime is thread-safe per instance and phase hooks tell members apart by ``member_id``).
Before ``RefitFailed`` such a fault was retried until a 120 s ``TimeoutError`` that did
not say why.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from elastic_refit.membership.client import EtcdClient
from elastic_refit.membership.keys import JobKeys
from elastic_refit.membership.watch import RangeWatcher

from elastic_refit.errors import RefitFailed
from elastic_refit.layout import parse_spec
from elastic_refit.runtime import ElasticRefit, RefitConfig, RefitLayouts
from elastic_refit.runtime.phases import PhaseHooks
from elastic_refit.testing.faults import fault_hooks
from elastic_refit.testing.pattern import allocate, check_pieces, fill_pieces

pytestmark = pytest.mark.etcd

# Trainers 0 and 1 are data-parallel replicas; inference ranks 2 and 3 are a 2-way
# tensor-parallel engine.
SPEC = parse_spec({
    "domains": [0, 0, 1, 1],
    "tensors": [
        {"name": "w", "shape": [32, 16], "dtype": "bfloat16",
         "source": {"mesh": [0, 1], "placements": ["R"]},
         "destination": {"mesh": [2, 3], "placements": ["S(0)"]}},
        {"name": "norm", "shape": [16], "dtype": "float32",
         "source": {"mesh": [0, 1], "placements": ["R"]},
         "destination": {"mesh": [2, 3], "placements": ["R"]}},
    ],
})
LAYOUTS = RefitLayouts(SPEC.source, SPEC.destination)
MEMBERS = (("trainer", "t0", 0), ("trainer", "t1", 1), ("inference", "i0", 2), ("inference", "i1", 3))
# Well below the 120 s default, so a regression fails the test instead of hanging it; the
# RefitFailed must arrive far sooner still.
VERSION_TIMEOUT_S = 60.0


def trainer_tensors(layout_rank: int, version: int) -> dict[str, Any]:
    tensors = allocate(SPEC.source, layout_rank, fill=0)
    fill_pieces(SPEC.source, layout_rank, tensors, seed=version)
    return tensors


def run_job(etcd: str, job: str, trainer_steps: Callable[[ElasticRefit, str, int], list[dict]],
            inference_versions: tuple[int, ...], hooks: PhaseHooks | None = None,
            **config: Any) -> dict[str, dict]:
    """Run the four members on threads (each context given ``hooks``); returns member_id
    -> report (``steps``, ``error``)."""
    reports: dict[str, dict] = {m: {"steps": []} for _, m, _ in MEMBERS}

    def run(role: str, member_id: str, layout_rank: int) -> None:
        report = reports[member_id]
        try:
            cfg = RefitConfig(job=job, role=role, member_id=member_id, layout_rank=layout_rank, etcd=(etcd,),
                              domain=f"d-{role}", version_timeout_s=VERSION_TIMEOUT_S, **config)
            if role == "trainer":
                with ElasticRefit(cfg, LAYOUTS, hooks=hooks) as refit:
                    report["steps"] = trainer_steps(refit, member_id, layout_rank)
                return
            params = allocate(SPEC.destination, layout_rank, fill=0)
            with ElasticRefit(cfg, LAYOUTS, parameters=params, hooks=hooks) as refit:
                for version in inference_versions:
                    start = time.monotonic()
                    try:
                        served = refit.wait_for_version(version)
                    except RefitFailed as exc:
                        report["steps"].append({"version": version, "failed": exc,
                                                "seconds": time.monotonic() - start})
                        continue
                    with refit.weights() as serving:
                        problems = check_pieces(SPEC.destination, layout_rank, params, seed=serving)
                    report["steps"].append({"version": version, "served": served, "problems": problems})
        except BaseException as exc:  # reported; the test decides
            report["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"

    threads = [threading.Thread(target=run, args=m, name=f"member-{m[1]}", daemon=True) for m in MEMBERS]
    for t in threads:
        t.start()
    deadline = time.monotonic() + VERSION_TIMEOUT_S + 30
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"members {hung} still running; reports: {reports}"
    return reports


def publish_all(versions: tuple[int, ...], bad: dict[tuple[str, int], Callable[[dict], dict]]):
    """Trainer steps: publish each version, with ``bad[(member_id, version)]`` applied to
    that member's tensors; a ``RefitFailed`` or a refusal (``ValueError``) is recorded and
    the trainer moves on."""
    def steps(refit: ElasticRefit, member_id: str, layout_rank: int) -> list[dict]:
        out = []
        for version in versions:
            tensors = trainer_tensors(layout_rank, version)
            tensors = bad.get((member_id, version), lambda t: t)(tensors)
            start = time.monotonic()
            try:
                commit = refit.publish(tensors, version)
                out.append({"version": version, "committed": commit.version, "seconds": time.monotonic() - start})
            except RefitFailed as exc:
                out.append({"version": version, "failed": exc, "seconds": time.monotonic() - start})
            except ValueError as exc:  # bad input, refused in publish
                out.append({"version": version, "refused": exc, "seconds": time.monotonic() - start})
        return out
    return steps


def version_records(etcd: str, job: str) -> dict[str, dict[int, dict]]:
    keys = JobKeys(job)
    out: dict[str, dict[int, dict]] = {"committed": {}, "failed": {}, "sources": {}}
    with EtcdClient([etcd]) as client:
        for kv in client.get_prefix(keys.versions_prefix).kvs:
            parsed = keys.parse_version_key(kv.key)
            if parsed is not None and parsed[1] == "sources":
                out["sources"].setdefault(parsed[0], {})[parsed[2]] = json.loads(kv.value)
            elif parsed is not None and parsed[1] in out:
                out[parsed[1]][parsed[0]] = json.loads(kv.value)
    return out


@contextlib.contextmanager
def keys_written(etcd: str, prefix: str):
    """Every key put under ``prefix`` while the block runs: the coordinator prunes older
    versions' keys after later commits, so the final state would not show them."""
    written: list[str] = []
    with EtcdClient([etcd]) as client:
        watcher = RangeWatcher(client, prefix, prefix[:-1] + "0", name="written")  # '0' follows '/'
        watcher.add_listener(lambda reset, events, snap: written.extend(
            list(snap.items) if reset else [e.key for e in events if e.kind == "put"]))
        watcher.start()
        try:
            yield written
        finally:
            watcher.stop()
    assert watcher.relists == 1, "the watch relisted: some writes may be missing"


def assert_no_errors(reports: dict[str, dict]) -> None:
    errors = {m: r["error"] for m, r in reports.items() if "error" in r}
    assert not errors, errors


def test_a_missing_buffer_is_refused_in_publish_and_fails_the_version_everywhere_at_once(etcd_server):
    """t0 (the coordinator) publishes version 2 without buffer 'w': its ``publish`` raises
    the one-line ``ValueError`` at once, before any attempt (bad input is never retried),
    and fails version 2 for the job (every live trainer must source a version), so t1 and
    the inference ranks raise ``RefitFailed`` with that cause at once. Version 3 then
    commits bit-exactly."""
    etcd, job = etcd_server.endpoint, "job-" + uuid.uuid4().hex[:8]

    def drop_w(tensors: dict) -> dict:
        return {k: v for k, v in tensors.items() if k != "w"}

    with keys_written(etcd, JobKeys(job).sources(2)) as sources_of_2:
        reports = run_job(etcd, job, publish_all((1, 2, 3), {("t0", 2): drop_w}), inference_versions=(1, 2, 3))
    assert_no_errors(reports)
    message = "trainer 't0', version 2: published buffer 'w' is missing"
    one, two, three = reports["t0"]["steps"]
    assert one["committed"] == 1 and three["committed"] == 3, reports["t0"]
    assert str(two["refused"]) == message
    assert two["seconds"] < 2.0, f"the refusal took {two['seconds']:.1f} s"
    one, two, three = reports["t1"]["steps"]
    assert one["committed"] == 1 and three["committed"] == 3, reports["t1"]
    assert (two["failed"].version, two["failed"].num_attempts) == (2, 0)
    assert two["failed"].cause == f"ValueError: {message}"
    assert str(two["failed"]) == f"version 2 was refused: ValueError: {message}"
    assert two["seconds"] < 10.0, f"t1 waited {two['seconds']:.1f} s for the refused version"
    for rank in ("i0", "i1"):
        one, two, three = reports[rank]["steps"]
        assert one["served"] == 1 and three["served"] == 3 and not one["problems"] and not three["problems"]
        assert isinstance(two["failed"], RefitFailed) and two["failed"].cause == f"ValueError: {message}"
    records = version_records(etcd, job)
    assert sorted(records["committed"]) == [1, 3]
    assert records["failed"][2]["num_attempts"] == 0
    assert JobKeys(job).source(2, "t0") not in sources_of_2, "t0's refused version 2 reached etcd as a source"


def test_a_fault_after_the_agreement_fails_the_version_across_rebuilt_communicators(etcd_server):
    """i1 fails every transfer of version 2 (a bug after the plan was agreed): it aborts the
    transport, its peers see transport faults, the epoch's communicator breaks and is
    rebuilt with the same members, and the attempts still add up under i1's cause, not the
    transport's."""
    etcd, job = etcd_server.endpoint, "job-" + uuid.uuid4().hex[:8]

    def hook(phase: str, context) -> None:
        if phase == "transfer.before" and context["member_id"] == "i1" and context.get("version") == 2:
            raise RuntimeError("injected bug in i1's transfer of version 2")

    reports = run_job(etcd, job, publish_all((1, 2, 3), {}), inference_versions=(1, 3), max_attempts=3,
                      hooks=PhaseHooks((hook,)))
    assert_no_errors(reports)
    for trainer in ("t0", "t1"):
        one, two, three = reports[trainer]["steps"]
        assert one["committed"] == 1 and three["committed"] == 3, reports[trainer]
        assert (two["failed"].version, two["failed"].num_attempts) == (2, 3)
        assert two["failed"].cause == "RuntimeError: injected bug in i1's transfer of version 2"
        assert two["seconds"] < 30.0, f"{trainer}: RefitFailed took {two['seconds']:.1f} s"
    for rank in ("i0", "i1"):
        assert [s["served"] for s in reports[rank]["steps"]] == [1, 3]
        assert not any(s["problems"] for s in reports[rank]["steps"])


def assert_only_version_2_refused(reports: dict[str, dict], cause: str) -> None:
    """Versions 1 and 3 committed and were served verified; version 2 raised ``RefitFailed``
    with ``cause`` on every member (trainers in ``publish``, inference in the wait)."""
    for trainer in ("t0", "t1"):
        one, two, three = reports[trainer]["steps"]
        assert one["committed"] == 1 and three["committed"] == 3, reports[trainer]
        assert (two["failed"].version, two["failed"].cause) == (2, cause), two
    for rank in ("i0", "i1"):
        one, two, three = reports[rank]["steps"]
        assert one["served"] == 1 and three["served"] == 3 and not one["problems"] and not three["problems"]
        assert isinstance(two["failed"], RefitFailed) and two["failed"].cause == cause


def test_a_source_buffer_changed_mid_transfer_is_never_committed(etcd_server):
    """t0's buffer 'w' changes while version 2 is in flight, as its send is posted (an
    optimizer step that did not wait for ``publish``): the bytes on the wire check out, but
    they need not be what was published. t0 finds its buffers changed against the digests
    taken at publish, version 2 is refused for the job and never committed, no inference
    rank acks it, and every member raises ``RefitFailed`` naming t0 and 'w'. Version 3
    then commits, verified."""
    etcd, job = etcd_server.endpoint, "job-" + uuid.uuid4().hex[:8]
    held: dict[str, dict] = {}  # t0's version-2 tensors, as published

    def keep(tensors: dict) -> dict:
        held["t0"] = tensors
        return tensors

    def hook(phase: str, context) -> None:
        if phase == "transfer.before" and context["member_id"] == "t0" and context.get("version") == 2:
            context["transport"].inject(lambda: held["t0"]["w"].add_(1), after=0, op="send")

    with keys_written(etcd, JobKeys(job).acks(2)) as acks_of_2:
        reports = run_job(etcd, job, publish_all((1, 2, 3), {("t0", 2): keep}), inference_versions=(1, 2, 3),
                          hooks=fault_hooks(hook))
    assert_no_errors(reports)
    cause = ("SourceChanged: trainer 't0': published buffers ['w'] changed while version 2 was in flight; "
             "it is refused, publish a new version once they hold still")
    assert_only_version_2_refused(reports, cause)
    records = version_records(etcd, job)
    assert sorted(records["committed"]) == [1, 3] and records["failed"][2]["cause"] == cause
    assert not acks_of_2, f"inference ranks acked the torn version 2: {acks_of_2}"


def test_diverged_replicas_are_refused_naming_the_tensor_region_and_ranks(etcd_server):
    """t0 and t1 are data-parallel replicas; for version 2 t1 holds other values in one
    element of 'w' (a gradient left unreduced). The coordinator compares the replicas'
    digests of every shared region before anything moves and refuses version 2, naming the
    tensor, the region and both ranks; version 3 commits, verified."""
    etcd, job = etcd_server.endpoint, "job-" + uuid.uuid4().hex[:8]

    def diverge(tensors: dict) -> dict:
        w = tensors["w"].clone()
        w[3, 5] = -w[3, 5] if float(w[3, 5]) != 0 else 1.0
        return {**tensors, "w": w}

    reports = run_job(etcd, job, publish_all((1, 2, 3), {("t1", 2): diverge}), inference_versions=(1, 2, 3))
    assert_no_errors(reports)
    cause = ("ValueError: source replicas disagree on tensor 'w' region [0:32, 0:16]: rank 0 (t0) and rank 1 (t1) "
             "hold different values")
    assert_only_version_2_refused(reports, cause)
    assert all(reports[t]["steps"][1]["failed"].num_attempts == 0 for t in ("t0", "t1"))
    records = version_records(etcd, job)
    assert sorted(records["committed"]) == [1, 3] and records["failed"][2]["cause"] == cause
