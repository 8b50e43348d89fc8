"""A mistake across members reaches every caller as one error naming the cause, in seconds.

Each row is one mistake a new user or an operator makes (the two sides' layouts disagree, two
members claim one layout rank or one member_id, formats or plan settings that disagree, a
bucket too small to plan). Real etcd, real gloo; the members run in this process, one thread
each. Every member's ``publish`` / ``wait_for_version`` must raise within 2 x TTL + 1 s of
its call, naming the cause; before issue 34 each waited out ``version_timeout_s`` (120 s by
default) and raised ``RefitTimeout: ... no attempt failed on this rank``, the cause only a
warning in some member's log.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from elastic_refit.cli import main
from elastic_refit.errors import RefitFailed
from elastic_refit.layout import Layout, TensorFormats, parse_spec
from elastic_refit.plan import destination_format_layout
from elastic_refit.runtime import ElasticRefit, RefitConfig
from elastic_refit.testing.pattern import allocate, fill_pieces

from .test_refit_failures import version_records

pytestmark = pytest.mark.etcd

TTL_S = 2
BOUND_S = 2 * TTL_S + 1.0
# A regression fails the row instead of hanging it; the error must come far sooner.
VERSION_TIMEOUT_S = 30.0


def _layouts(w_shape=(128, 128), w_dtype="bfloat16", *, extra: bool = False, fmt: str | None = None):
    """One trainer (rank 0) -> a 2-way tensor-parallel engine (ranks 1 and 2): ``w`` as
    given on the destination side (the trainer always holds ``w`` [128, 128] bfloat16)."""
    def tensors(shape, dtype, with_extra, fmt):
        dst = {"mesh": [1, 2], "placements": ["S(0)"], **({"format": fmt} if fmt else {})}
        out = [{"name": "w", "shape": list(shape), "dtype": dtype, "source": {"mesh": [0], "placements": ["R"]},
                "destination": dst}]
        if with_extra:
            out.append({"name": "x", "shape": [8], "dtype": "float32", "source": {"mesh": [0], "placements": ["R"]},
                        "destination": {"mesh": [1, 2], "placements": ["R"]}})
        return out

    trainer = parse_spec({"domains": [0, 1, 1], "tensors": tensors((128, 128), "bfloat16", False, None)})
    engine = parse_spec({"domains": [0, 1, 1], "tensors": tensors(w_shape, w_dtype, extra, fmt)})
    return trainer.source, engine.destination, engine.destination_formats


SOURCE, DESTINATION, _ = _layouts()


@dataclass(frozen=True)
class Member:
    role: str
    member_id: str
    layout_rank: int
    layout: Layout
    formats: TensorFormats | None = None
    config: dict[str, Any] = field(default_factory=dict)
    after: str | None = None  # start once this member has started
    delay_s: float = 0.0  # start this much later (a late rank)


def members(destination: Layout = DESTINATION, formats: tuple[TensorFormats | None, TensorFormats | None] = (None, None),
            ranks: tuple[int, int] = (1, 2), ids: tuple[str, str] = ("i0", "i1"), **config: Any) -> tuple[Member, ...]:
    return (Member("trainer", "t0", 0, SOURCE, config=config),
            Member("inference", ids[0], ranks[0], destination, formats[0], config),
            Member("inference", ids[1], ranks[1], destination, formats[1], config, after="t0" if ids[1] == "t0" else None))


_FP8 = _layouts(fmt="fp8-block128")
# (a floating dtype is a cast, layout.casts: the trainer's bfloat16 lands as float32; int32 is not)
SHAPE, DTYPE, EXTRA = (_layouts((128, 64))[1], _layouts(w_dtype="int32")[1], _layouts(extra=True)[1])

# (name, members, member_id -> expected cause (a substring of its error; None: it serves version 1))
CASES = [
    ("shape", members(SHAPE), "tensor 'w': source is [128, 128] bfloat16, destination is [128, 64] bfloat16"),
    ("dtype", members(DTYPE), "tensor 'w': source is [128, 128] bfloat16, destination is [128, 128] int32"),
    ("tensor only one side has", members(EXTRA), "tensor 'x' is in the destination layout but not in the source"),
    ("two members claim one layout rank", members(ranks=(1, 1)), "members 'i0' and 'i1' both hold rank 1 of layout"),
    ("formats that disagree", members(_FP8[1], formats=(_FP8[2], None)),
     "inference members 'i0' and 'i1' declare different destination formats"),
    ("a bucket too small to plan", members(bucket_bytes=2, staging_bytes=1 << 20),
     "a bucket of 2 bytes cannot hold two elements of every tensor"),
    ("plan settings that disagree",
     (Member("trainer", "t0", 0, SOURCE, config={"bucket_bytes": 4096}),
      Member("inference", "i0", 1, DESTINATION), Member("inference", "i1", 2, DESTINATION)),
     "PlanMismatch"),
    ("one member_id in both roles", members(ids=("i0", "t0"), ranks=(1, 2)),
     {"trainer:t0": None, "i0": None, "inference:t0": "member_id 't0' is already registered in job"}),
    # A TP rank that starts after the commit: its peer holds only its own shard and the
    # trainer released the version, so the version cannot reach it (the next one will).
    ("a late inference rank",
     (Member("trainer", "t0", 0, SOURCE), Member("inference", "i0", 1, DESTINATION),
      Member("inference", "i1", 2, DESTINATION, delay_s=2 * TTL_S)),
     {"t0": None, "i0": None, "i1": "VersionUnreachable: i1: committed version 1 cannot reach this rank: tensor 'w'"}),
]


def run_members(etcd: str, job: str, spec: tuple[Member, ...]) -> dict[str, tuple[str | None, float]]:
    """Run ``spec``'s members on threads: each trainer publishes version 1, each inference
    rank waits for it. Returns ``role:member_id`` (or ``member_id`` when unique) -> (its
    error as ``Type: message``, None if it served version 1; seconds its call took)."""
    results: dict[str, tuple[str | None, float]] = {}
    started = {m.member_id + m.role: threading.Event() for m in spec}
    called = {m.member_id + m.role: threading.Event() for m in spec}
    ids = [m.member_id for m in spec]

    def stay(m: Member) -> None:
        """A member stays in the job until every member's call is over (as in a job)."""
        called[m.member_id + m.role].set()
        for event in called.values():
            event.wait(VERSION_TIMEOUT_S)

    def name(m: Member) -> str:
        return m.member_id if ids.count(m.member_id) == 1 else f"{m.role}:{m.member_id}"

    def call(m: Member, what) -> None:
        """Time ``what()`` (publish or wait), record its outcome, then stay in the job."""
        t0 = time.monotonic()
        try:
            what()
            results[name(m)] = (None, time.monotonic() - t0)
        except BaseException as exc:  # the row decides
            results[name(m)] = (f"{type(exc).__name__}: {exc}", time.monotonic() - t0)
        finally:
            stay(m)

    def run(m: Member) -> None:
        if m.after is not None:
            started[m.after + "trainer"].wait(30)
            time.sleep(0.5)
        time.sleep(m.delay_s)
        t0 = time.monotonic()
        try:
            config = RefitConfig(job=job, role=m.role, member_id=m.member_id, layout_rank=m.layout_rank, etcd=(etcd,),
                                 domain=f"d-{m.role}", ttl_s=TTL_S, version_timeout_s=VERSION_TIMEOUT_S, **m.config)
            if m.role == "trainer":
                with ElasticRefit(config, m.layout) as refit:
                    started[m.member_id + m.role].set()
                    tensors = allocate(m.layout, m.layout_rank, fill=0)
                    fill_pieces(m.layout, m.layout_rank, tensors, seed=1)
                    call(m, lambda: refit.publish(tensors, 1))
            else:
                buffers = m.layout if m.formats is None else destination_format_layout(m.layout, m.formats)
                params = allocate(buffers, m.layout_rank, fill=0)
                with ElasticRefit(config, m.layout, parameters=params, formats=m.formats) as refit:
                    call(m, lambda: refit.wait_for_version(1))
        except BaseException as exc:  # a start that failed: the row decides
            results.setdefault(name(m), (f"{type(exc).__name__}: {exc}", time.monotonic() - t0))
        finally:
            started[m.member_id + m.role].set()
            called[m.member_id + m.role].set()

    threads = [threading.Thread(target=run, args=(m,), daemon=True, name=f"member-{m.member_id}") for m in spec]
    for t in threads:
        t.start()
    for t in threads:
        t.join(VERSION_TIMEOUT_S + 30)
    assert not any(t.is_alive() for t in threads), f"members still running; results so far: {results}"
    return results


@pytest.mark.parametrize(("name", "spec", "expected"), CASES, ids=[c[0] for c in CASES])
def test_a_mistake_across_members_reaches_every_caller_naming_its_cause(etcd_server, job, name, spec, expected,
                                                                        capsys):
    results = run_members(etcd_server.endpoint, job, spec)
    every = expected if isinstance(expected, dict) else dict.fromkeys(results, expected)
    assert set(results) == set(every), results
    for who, cause in every.items():
        error, seconds = results[who]
        if cause is None:
            assert error is None, f"{name}: {who} should have served version 1, got {error}"
            continue
        assert error is not None and cause in error, f"{name}: {who} raised {error!r}, expected {cause!r}"
        assert "\n" not in error.strip(), f"{name}: {who}'s error is not one line: {error!r}"
        assert seconds <= BOUND_S, f"{name}: {who} raised after {seconds:.1f} s (bound {BOUND_S} s): {error}"
    slowest = max((sec for who, (_, sec) in results.items() if every[who] is not None), default=0.0)
    print(f"time-to-error {name}: {slowest:.2f} s (bound {BOUND_S} s)")
    if isinstance(expected, str):  # the version's failed record names the cause (status shows it)
        failed = version_records(etcd_server.endpoint, job)["failed"]
        assert 1 in failed and expected in failed[1]["cause"], failed
        capsys.readouterr()
        assert main(["status", "--etcd", etcd_server.endpoint, "--job", job]) == 0
        shown = capsys.readouterr().out
        assert f"v1 {'failed after' if failed[1]['num_attempts'] else 'was refused'}" in shown and expected in shown, shown


def test_a_failed_version_is_why_a_wait_for_any_version_ends(etcd_server, job):
    """``wait_for_version()`` (any version) in a job that committed nothing raises the
    newest failed version's cause instead of timing out."""
    spec = members(SHAPE)
    results = run_members(etcd_server.endpoint, job, spec)
    assert all(e is not None and "RefitFailed" in e for e, _ in results.values()), results
    config = RefitConfig(job=job, role="inference", member_id="i9", layout_rank=1, etcd=(etcd_server.endpoint,),
                         ttl_s=TTL_S)
    with ElasticRefit(config, SHAPE, parameters=allocate(SHAPE, 1, fill=0)) as refit:
        t0 = time.monotonic()
        with pytest.raises(RefitFailed, match="tensor 'w': source is"):
            refit.wait_for_version(timeout_s=VERSION_TIMEOUT_S)
        assert time.monotonic() - t0 < BOUND_S
