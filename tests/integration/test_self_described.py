"""Each side describes only itself, through etcd, and may change its layout between versions.

Real etcd, real gloo communicators; members run on threads of this process (the runtime is
thread-safe per instance). No member is given the other side's layout: every ``ElasticRefit``
gets a ``Layout`` of its own side, in its own side's rank space, and the runtime plans each
attempt from the layouts the members published. Every destination byte is checked against
the pattern the trainers wrote (global coordinates, so one check works for any layout).
"""

from __future__ import annotations

import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from elastic_refit.layout import Layout, LayoutBuilder, add_sharded_tensor
from elastic_refit.runtime import ElasticRefit, RefitConfig
from elastic_refit.testing.pattern import allocate, check_pieces, fill_pieces

pytestmark = pytest.mark.etcd

NUM_EXPERTS, EXPERT_SHAPE = 4, (8, 6)


def trainer_side() -> Layout:
    """Two data-parallel trainer replicas (ranks 0 and 1 of the training side)."""
    b = LayoutBuilder()
    add_sharded_tensor(b, "w", (32, 16), "bfloat16", [0, 1], ["R"])
    add_sharded_tensor(b, "experts", (NUM_EXPERTS, *EXPERT_SHAPE), "float32", [0, 1], ["R"])
    add_sharded_tensor(b, "norm", (16,), "float32", [0, 1], ["R"])
    return b.build()


def inference_side(expert_placement: Sequence[Sequence[int]], w_placement: Sequence[str] = ("S(0)", "S(0)")) -> Layout:
    """Two inference ranks: ``w`` row-sharded (``"S(0)"``) or whole (``"R"``) per rank, the
    experts of rank r are ``expert_placement[r]`` (in that local order), ``norm`` replicated."""
    b = LayoutBuilder()
    t = b.tensor("w", (32, 16), "bfloat16")
    for rank, placement in enumerate(w_placement):
        rows = (0, 32) if placement == "R" else (16 * rank, 16)
        ids = b.buffers("w", [rank], (rows[1], 16), "bfloat16")
        b.pieces(t, ids, [[rows[0], 0]], [[rows[1], 16]], [[0, 0]])
    t = b.tensor("experts", (NUM_EXPERTS, *EXPERT_SHAPE), "float32")
    for rank, experts in enumerate(expert_placement):
        ids = b.buffers("experts", [rank], (len(experts), *EXPERT_SHAPE), "float32")
        for local, expert in enumerate(experts):
            b.pieces(t, ids, [[expert, 0, 0]], [[1, *EXPERT_SHAPE]], [[local, 0, 0]])
    add_sharded_tensor(b, "norm", (16,), "float32", [0, 1], ["R"])
    return b.build()


BLOCKED = inference_side([[0, 1], [2, 3]])
REPLACED = inference_side([[3, 0], [1, 2]])  # an expert-parallel load balancer moved every expert


class Job:
    """Members on threads; each reports its steps or its error."""

    def __init__(self, etcd: str) -> None:
        self.etcd = etcd
        self.job = f"job-{uuid.uuid4().hex[:8]}"
        self.reports: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[str, str, dict[str, Any]]] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def config(self, role: str, member_id: str, layout_rank: int) -> RefitConfig:
        return RefitConfig(job=self.job, role=role, member_id=member_id, layout_rank=layout_rank,
                           etcd=(self.etcd,), domain=f"d-{member_id}" if role == "inference" else "d-train",
                           version_timeout_s=60.0)

    def on_event(self, member_id: str) -> Callable[[str, dict[str, Any]], None]:
        def listener(name: str, fields: dict[str, Any]) -> None:
            with self._lock:
                self.events.append((member_id, name, dict(fields)))
        return listener

    def run(self, member_id: str, body: Callable[[dict[str, Any]], None]) -> None:
        report: dict[str, Any] = {"steps": []}
        self.reports[member_id] = report

        def target() -> None:
            try:
                body(report)
            except BaseException as exc:  # reported; the test decides
                report["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"

        thread = threading.Thread(target=target, name=f"member-{member_id}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def join(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = [t.name for t in self._threads if t.is_alive()]
        assert not hung, f"members {hung} still running; reports: {self.reports}"
        errors = {m: r["error"] for m, r in self.reports.items() if "error" in r}
        assert not errors, errors

    def plans(self, version: int) -> list[dict[str, Any]]:
        with self._lock:
            return [f for _, name, f in self.events if name == "refit.plan.built" and f.get("version") == version]


def trainer(job: Job, member_id: str, rank: int, versions: Sequence[int], before: Callable[[int], None]) -> None:
    layout = trainer_side()

    def body(report: dict[str, Any]) -> None:
        with ElasticRefit(job.config("trainer", member_id, rank), layout, on_event=job.on_event(member_id)) as refit:
            for version in versions:
                before(version)
                tensors = allocate(layout, rank, fill=0)
                fill_pieces(layout, rank, tensors, seed=version)
                report["steps"].append(refit.publish(tensors, version).version)
    job.run(member_id, body)


def serve(refit: ElasticRefit, layout: Layout, rank: int, params: dict, version: int, report: dict) -> None:
    served = refit.wait_for_version(version)
    with refit.weights() as serving:
        problems = check_pieces(layout, rank, params, seed=serving)
    report["steps"].append({"version": version, "served": served, "layout": layout.fingerprint,
                            "problems": problems})


def assert_served(job: Job, member_id: str, expected: list[tuple[int, Layout]]) -> None:
    steps = job.reports[member_id]["steps"]
    assert [(s["version"], s["served"], s["layout"]) for s in steps] == [(v, v, lay.fingerprint) for v, lay in expected]
    assert all(s["problems"] == [] for s in steps), steps


def test_sides_configured_only_with_their_own_layouts_refit_through_etcd(etcd_server):
    """No member knows the other side: the trainers hold two replicas (ranks 0, 1 of their
    side), the engine two ranks of its own (also 0, 1); the plan comes from etcd."""
    job = Job(etcd_server.endpoint)
    for member_id, rank in (("t0", 0), ("t1", 1)):
        trainer(job, member_id, rank, (1, 2), before=lambda v: None)
    for member_id, rank in (("i0", 0), ("i1", 1)):
        def body(report: dict[str, Any], member_id: str = member_id, rank: int = rank) -> None:
            params = allocate(BLOCKED, rank, fill=0)
            with ElasticRefit(job.config("inference", member_id, rank), BLOCKED, parameters=params,
                              on_event=job.on_event(member_id)) as refit:
                for version in (1, 2):
                    serve(refit, BLOCKED, rank, params, version, report)
        job.run(member_id, body)
    job.join()
    assert job.reports["t0"]["steps"] == [1, 2] and job.reports["t1"]["steps"] == [1, 2]
    for member_id in ("i0", "i1"):
        assert_served(job, member_id, [(1, BLOCKED), (2, BLOCKED)])
    plans = job.plans(2)
    assert plans and all(p["cross_domain_bytes"] == p["lower_bound_bytes"] for p in plans), plans


def test_experts_replaced_between_versions_commit_bit_exact_at_the_new_lower_bound(etcd_server):
    """Version 1 lands in the blocked expert placement; then both inference ranks re-place
    every expert (``update_layout``) and version 2 lands in the new placement, every byte
    checked, with the plan's cross-domain bytes at the new layout's lower bound."""
    job = Job(etcd_server.endpoint)
    replaced = threading.Barrier(3)  # both inference ranks re-placed, and the trainers may go on

    def before(version: int) -> None:
        if version == 2:
            replaced.wait(timeout=60)

    trainer(job, "t0", 0, (1, 2), before=lambda v: before(v))
    trainer(job, "t1", 1, (1, 2), before=lambda v: None)
    for member_id, rank in (("i0", 0), ("i1", 1)):
        def body(report: dict[str, Any], member_id: str = member_id, rank: int = rank) -> None:
            params = allocate(BLOCKED, rank, fill=0)
            with ElasticRefit(job.config("inference", member_id, rank), BLOCKED, parameters=params,
                              on_event=job.on_event(member_id)) as refit:
                serve(refit, BLOCKED, rank, params, 1, report)
                new_params = allocate(REPLACED, rank, fill=0)
                refit.update_layout(REPLACED, new_params)
                assert refit.serving_version is None  # the new buffers hold no version yet
                replaced.wait(timeout=60)
                serve(refit, REPLACED, rank, new_params, 2, report)
        job.run(member_id, body)
    job.join()
    for member_id in ("i0", "i1"):
        assert_served(job, member_id, [(1, BLOCKED), (2, REPLACED)])
    # Every inference rank is its own domain: each needs its half of w, its two experts and
    # the norm once; the trainers' domain needs nothing.
    expert_bytes = int(np.prod(EXPERT_SHAPE)) * 4
    bound = 2 * (16 * 16 * 2 + 2 * expert_bytes + 16 * 4)
    plans = job.plans(2)
    assert plans, "no plan of version 2 was built"
    assert all(p["cross_domain_bytes"] == p["lower_bound_bytes"] for p in plans), plans
    # The first attempt sends to both ranks; a retry after a fault may send to one only.
    assert max(p["lower_bound_bytes"] for p in plans) == bound, plans


def test_an_inference_rank_rejoins_with_a_different_layout(etcd_server):
    """i1 leaves after version 1 and comes back (a new incarnation) holding the whole of ``w``
    instead of its row shard and other experts; i0 keeps its layout. Version 2 commits with
    each rank checked against the layout it described."""
    job = Job(etcd_server.endpoint)
    rejoined = threading.Event()
    served_v1 = threading.Barrier(3)
    wide = inference_side([[0, 1], [0, 3]], w_placement=("S(0)", "R"))

    def before(version: int) -> None:
        if version == 2:
            served_v1.wait(timeout=60)
            assert rejoined.wait(timeout=60)

    trainer(job, "t0", 0, (1, 2), before=before)
    trainer(job, "t1", 1, (1, 2), before=lambda v: None)

    def i0(report: dict[str, Any]) -> None:
        params = allocate(BLOCKED, 0, fill=0)
        with ElasticRefit(job.config("inference", "i0", 0), BLOCKED, parameters=params,
                          on_event=job.on_event("i0")) as refit:
            serve(refit, BLOCKED, 0, params, 1, report)
            served_v1.wait(timeout=60)
            serve(refit, BLOCKED, 0, params, 2, report)

    def i1(report: dict[str, Any]) -> None:
        params = allocate(BLOCKED, 1, fill=0)
        with ElasticRefit(job.config("inference", "i1", 1), BLOCKED, parameters=params,
                          on_event=job.on_event("i1")) as refit:
            serve(refit, BLOCKED, 1, params, 1, report)
        served_v1.wait(timeout=60)
        params = allocate(wide, 1, fill=0)
        with ElasticRefit(job.config("inference", "i1", 1), wide, parameters=params,
                          on_event=job.on_event("i1")) as refit:
            rejoined.set()
            serve(refit, wide, 1, params, 2, report)

    job.run("i0", i0)
    job.run("i1", i1)
    job.join()
    assert_served(job, "i0", [(1, BLOCKED), (2, BLOCKED)])
    assert_served(job, "i1", [(1, BLOCKED), (2, wide)])
    plans = job.plans(2)
    assert plans and all(p["cross_domain_bytes"] == p["lower_bound_bytes"] for p in plans), plans
