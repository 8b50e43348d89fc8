"""Sides described by rules travel through a real etcd as rules (ERL3), kilobytes whatever the
number of ranks; sides built piece by piece keep travelling as pieces (ERL1/ERL2)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from elastic_refit.membership.client import EtcdClient
from elastic_refit.membership.keys import JobKeys
from elastic_refit.membership.layouts import LayoutStore
from elastic_refit.membership.service import Membership
from elastic_refit.membership.view import MemberRecord

from elastic_refit.layout import LayoutBuilder, TensorFormats, add_sharded_tensor
from elastic_refit.layout.encoding import decode_described
from elastic_refit.layout.symbolic import rules_of
from elastic_refit.layout.symbolic_presets import megatron_symbolic, vllm_symbolic
from elastic_refit.runtime.layouts import LayoutCache

pytestmark = pytest.mark.etcd

_COLUMNS = ("buffer_rank", "buffer_name", "buffer_shape", "piece_tensor", "piece_buffer", "piece_offsets",
            "piece_lengths", "piece_local_offsets", "piece_local_lengths")


def _same_rows(a, b) -> bool:
    return a.tensors == b.tensors and all(np.array_equal(getattr(a, c), getattr(b, c)) for c in _COLUMNS)


def _layout_bytes(client: EtcdClient, job: str, fingerprint: str) -> int:
    keys = JobKeys(job)
    header = client.get(keys.layout(fingerprint))
    return len(header.value) + sum(len(kv.value) for kv in client.get_prefix(keys.layout(fingerprint) + "/").kvs)


def test_rules_travel_as_rules_with_their_formats_and_pieces_as_pieces(etcd_server):
    job = f"job-{uuid.uuid4().hex[:8]}"
    trainer = megatron_symbolic("qwen3-30b-a3b", "tp=2,pp=2,dp=2,ep=4")
    inference = vllm_symbolic("qwen3-30b-a3b", "tp=2,dp=2", first_rank=16)
    formats = TensorFormats.from_mapping({"model.layers.0.self_attn.q_proj.weight": "fp8-block128"})
    plain = LayoutBuilder()
    add_sharded_tensor(plain, "w", (64, 8), "float32", np.arange(4).reshape(2, 2), ["S(0)", "S(1)"])
    plain = plain.build()
    with EtcdClient([etcd_server.endpoint]) as client:
        record = MemberRecord("trainer", "t0", "inc0", "h", "d", "cpu", layout_rank=0, layout="")
        with Membership(client, job, record) as membership:
            store = LayoutStore(client, job)
            mine = LayoutCache(store)
            # a layout built from rules (to_layout keeps them) and a SymbolicLayout both publish rules
            explicit_trainer = trainer.to_layout()
            assert rules_of(explicit_trainer) is trainer
            t_fp = mine.publish(membership, explicit_trainer)
            i_fp = mine.publish(membership, inference, formats)
            p_fp = mine.publish(membership, plain)
            assert t_fp == trainer.fingerprint == explicit_trainer.fingerprint
            assert store.get(t_fp)[:4] == b"ERL3" and store.get(i_fp)[:4] == b"ERL3"
            assert store.get(p_fp)[:4] == b"ERL1"  # built piece by piece: pieces, as before
            # a peer (a fresh cache) reads all three
            peer = LayoutCache(store)
            assert peer.rules(t_fp).fingerprint == t_fp and peer.rules(p_fp) is None
            assert _same_rows(peer.get(t_fp), explicit_trainer)
            layout, got_formats = peer.described(i_fp)
            assert got_formats == formats and _same_rows(layout, inference.to_layout())
            assert peer.formats_of(record, i_fp) == formats
            assert _same_rows(peer.get(p_fp), plain)
            # what a member of an earlier version reads (decode_described) is the same side
            assert decode_described(store.get(i_fp), i_fp)[1] == formats
            # a job whose members cannot read ERL3 publishes pieces
            legacy = LayoutCache(store, publish_rules=False)
            other = megatron_symbolic("qwen3-30b-a3b", "tp=2,pp=2,dp=2,ep=4", first_rank=32)
            o_fp = legacy.publish(membership, other)
            assert store.get(o_fp)[:4] == b"ERL1" and _same_rows(LayoutCache(store).get(o_fp), other.to_layout())


def test_the_layout_keys_of_a_65536_gpu_job_stay_far_below_a_mebibyte_per_side(etcd_server):
    """Kimi-K2, pp=16,ep=64,dp=2048 -> tp=16,dp=2048: each side's keys in etcd, header and chunks."""
    job = f"job-{uuid.uuid4().hex[:8]}"
    trainer = megatron_symbolic("kimi-k2", "pp=16,ep=64,dp=2048")
    inference = vllm_symbolic("kimi-k2", "tp=16,dp=2048", first_rank=16 * 2048)
    with EtcdClient([etcd_server.endpoint]) as client:
        record = MemberRecord("trainer", "t0", "inc0", "h", "d", "cpu", layout_rank=0, layout="")
        with Membership(client, job, record) as membership:
            cache = LayoutCache(LayoutStore(client, job))
            for side in (trainer, inference):
                fingerprint = cache.publish(membership, side)
                assert _layout_bytes(client, job, fingerprint) < 64 << 10  # ~15 kB (ERL1 at 8,192 GPUs: 23.5 MiB)
                # a peer gets the rules without building any piece
                assert LayoutCache(LayoutStore(client, job)).rules(fingerprint).fingerprint == fingerprint


def test_members_holding_layouts_built_from_rules_refit_through_etcd_as_rules(etcd_server):
    """ElasticRefit members whose layouts come from rules (``SymbolicLayout.to_layout``) publish
    ERL3 and plan from each other's rules; every destination byte arrives."""
    from typing import Any

    from elastic_refit.layout.symbolic_build import SymbolicBuilder
    from elastic_refit.runtime import ElasticRefit
    from elastic_refit.testing.pattern import allocate, fill_pieces

    from .test_self_described import Job, serve

    def side(placements) -> Any:
        b = SymbolicBuilder()
        b.sharded_tensor("w", (32, 16), "bfloat16", [0, 1], [placements[0]])
        b.sharded_tensor("norm", (16,), "float32", [0, 1], [placements[1]])
        return b.build().to_layout()

    trainer_layout, inference_layout = side(("R", "R")), side(("S(0)", "R"))
    job = Job(etcd_server.endpoint)
    for member_id, rank in (("t0", 0), ("t1", 1)):
        def train(report: dict[str, Any], member_id: str = member_id, rank: int = rank) -> None:
            with ElasticRefit(job.config("trainer", member_id, rank), trainer_layout) as refit:
                tensors = allocate(trainer_layout, rank, fill=0)
                fill_pieces(trainer_layout, rank, tensors, seed=1)
                report["steps"].append(refit.publish(tensors, 1).version)
        job.run(member_id, train)
    for member_id, rank in (("i0", 0), ("i1", 1)):
        def infer(report: dict[str, Any], member_id: str = member_id, rank: int = rank) -> None:
            params = allocate(inference_layout, rank, fill=0)
            with ElasticRefit(job.config("inference", member_id, rank), inference_layout, parameters=params) as refit:
                serve(refit, inference_layout, rank, params, 1, report)
        job.run(member_id, infer)
    job.join()
    for member_id in ("i0", "i1"):
        steps = job.reports[member_id]["steps"]
        assert [(s["version"], s["served"], s["problems"]) for s in steps] == [(1, 1, [])]
    with EtcdClient([etcd_server.endpoint]) as client:
        store = LayoutStore(client, job.job)
        for layout in (trainer_layout, inference_layout):
            assert store.get(layout.fingerprint)[:4] == b"ERL3"
