"""Member processes of a local job (tests, the demo, chaos): trainers publish versions of
deterministic pattern data, inference ranks check every committed version bit-exactly."""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from elastic_refit.errors import VersionUnreachable
from elastic_refit.layout import TensorFormats
from elastic_refit.layout.casts import source_casts
from elastic_refit.membership.client import EtcdClient
from elastic_refit.membership.keys import JobKeys
from elastic_refit.membership.view import MembershipView
from elastic_refit.plan import destination_format_layout
from elastic_refit.runtime.config import RefitConfig, RefitLayouts
from elastic_refit.runtime.phases import PhaseHooks
from elastic_refit.runtime.refit import ElasticRefit
from elastic_refit.testing.pattern import (
    allocate,
    check_pieces,
    check_quantized,
    fill_finite,
    fill_pieces,
)
from elastic_refit.testing.versions import version_buffers, version_problems


@dataclass(frozen=True, slots=True)
class MemberSpec:
    """One member of a local job; layouts come from a spec file's JSON or a model preset."""

    job: str
    role: str
    member_id: str
    layout_rank: int
    etcd: tuple[str, ...]
    domain: str
    spec_json: str | None = None
    preset: tuple[Any, str, str, int | None] | None = None  # (model, source, destination, layers)
    versions: tuple[int, ...] = (1, 2, 3)
    mode: str = "in_place"
    incarnation: str | None = None
    pause_s: float = 0.0  # trainers: time between versions (a training step)
    # Trainers: publish(wait=False) and run the next step while the version moves (at most
    # one version in flight: the step's end waits for the previous commit).
    async_publish: bool = False
    # Trainers: make every version's weights before the loop and copy them in at each step,
    # so that the loop times the steps and the refits, not the pattern generator.
    weights_ahead: bool = False
    # Inference: check the bytes of the last version only (every version was verified by the
    # runtime's digests before it committed); a benchmark whose own byte-for-byte check of
    # each version would compete with the refit for the CPUs.
    check_last_only: bool = False
    # Trainers: publish the first version only once the epoch holds all of these members.
    # Tests whose fault must hit a rank inside a transfer need it: on a loaded machine a
    # late-starting rank otherwise joins after the versions are already committed.
    start_with: tuple[str, ...] = ()
    start_timeout_s: float = 120.0
    config: dict[str, Any] = field(default_factory=dict)
    # Inference: the destination formats it declares (``TensorFormats.to_json``) instead of
    # the spec's (a job whose inference ranks disagree).
    formats_json: str | None = None
    # Keep the first and last ``record_window`` committed versions only (see CommitRecord):
    # a soak's member must not grow with its versions, its report included.
    record_window: int | None = None
    # Deltas' tests: version k changes about this fraction of version k - 1's elements
    # (``testing.versions``) instead of being new data throughout.
    delta_density: float | None = None

    def layouts(self) -> RefitLayouts:
        if self.spec_json is not None:
            from elastic_refit.layout import parse_spec

            spec = parse_spec(json.loads(self.spec_json))
            return RefitLayouts(spec.source, spec.destination)
        model, source, destination, layers = self.preset  # type: ignore[misc]
        return RefitLayouts.from_preset(model, source, destination, num_layers=layers)

    def formats(self) -> TensorFormats:
        """The destination formats of the job's inference side: ``formats_json``, else the
        spec's (``"format"`` of its destinations); none for presets."""
        if self.formats_json is not None:
            return TensorFormats.from_json(self.formats_json)
        if self.spec_json is not None:
            from elastic_refit.layout import parse_spec

            return parse_spec(json.loads(self.spec_json)).destination_formats
        return TensorFormats()

    def refit_config(self) -> RefitConfig:
        """The member's ``RefitConfig``: its identity, and ``config`` over the rest (a
        ``domain`` there wins over the member's: a colocated job's members share one)."""
        extra = {"domain": self.domain, "mode": self.mode, **self.config}
        if self.incarnation:
            extra["incarnation"] = self.incarnation
        return RefitConfig(job=self.job, role=self.role, member_id=self.member_id, layout_rank=self.layout_rank,
                           etcd=self.etcd, **extra)


class CommitRecord:
    """The versions a member saw committed, in order: every entry, or with ``window`` the
    first and the last ``window`` entries and running counts (memory independent of the
    number of versions). :meth:`report` gives ``committed`` (those entries, in order),
    ``num_committed``, ``committed_span`` (first and last version) and
    ``committed_consecutive`` (each version the previous one plus 1)."""

    def __init__(self, window: int | None = None) -> None:
        if window is not None and window < 1:
            raise ValueError(f"record window must be at least 1, got {window}")
        self._window = window
        self._first: list[dict[str, Any]] = []
        self._last: collections.deque[dict[str, Any]] = collections.deque(maxlen=window)
        self._count = 0
        self._span: list[int] = []
        self._consecutive = True

    def append(self, entry: dict[str, Any]) -> None:
        version = int(entry["version"])
        if self._span:
            self._consecutive = self._consecutive and version == self._span[1] + 1
            self._span[1] = version
        else:
            self._span = [version, version]
        self._count += 1
        if self._window is None or len(self._first) < self._window:
            self._first.append(entry)
        else:
            self._last.append(entry)

    def report(self) -> dict[str, Any]:
        return {"committed": self._first + list(self._last), "num_committed": self._count,
                "committed_span": list(self._span), "committed_consecutive": self._consecutive}


class Pace(Protocol):
    """When a trainer may publish its next version, and what it has committed so far (a
    benchmark interleaving the versions of two jobs, as ``bench soak`` does)."""

    def wait_turn(self, version: int) -> None:
        """Returns once the trainer may publish ``version`` (its weights are made after)."""

    def committed(self, version: int) -> None:
        """``version`` committed (called after every commit, in order)."""


def wait_for_epoch_members(config: RefitConfig, member_ids: tuple[str, ...], timeout_s: float) -> None:
    """Until the job's current epoch (its view in etcd) holds every one of ``member_ids``;
    ``TimeoutError`` naming the missing ones after ``timeout_s``."""
    keys = JobKeys(config.job)
    deadline = time.monotonic() + timeout_s
    missing: list[str] = list(member_ids)
    with EtcdClient(list(config.etcd)) as client:
        while time.monotonic() < deadline:
            kv = client.get(keys.epoch)
            view = MembershipView.decode(kv.value) if kv is not None else None
            missing = [m for m in member_ids if view is None or m not in view]
            if not missing:
                return
            time.sleep(0.05)
    raise TimeoutError(f"members {missing} were not in the epoch of job {config.job!r} after {timeout_s} s")


@dataclass(frozen=True, slots=True)
class _MemberRun:
    """What one member's loop works with: its spec, layouts, config, device and formats,
    the context's phase hooks and ``hold`` (see ``run_member``)."""

    member: MemberSpec
    layouts: RefitLayouts
    config: RefitConfig
    device: torch.device
    formats: TensorFormats
    hooks: PhaseHooks | None
    hold: Callable[[ElasticRefit], None] | None


def run_member(member: MemberSpec, hold: Callable[[ElasticRefit], None] | None = None,
               pace: Pace | None = None, hooks: PhaseHooks | None = None) -> dict[str, Any]:
    """Run one member until its versions are done; returns what it saw. ``hooks``: the
    context's phase hooks (faults: ``elastic_refit.testing.faults.fault_hooks``).

    In a job whose inference side is quantized (``MemberSpec.formats``), trainers publish
    finite values (``pattern.finite_values``) and inference ranks hold FP8 weights and scales,
    every byte checked against the reference quantizer (``pattern.check_quantized``).

    ``hold(refit)`` runs inside the context once the last version is reached (chaos keeps
    members in the job until the whole trial is over); the stats are taken after it.
    ``pace`` (trainers) gates each publish and hears of each commit.
    """
    layouts = member.layouts()
    config = member.refit_config()
    device = torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out: dict[str, Any] = {"member_id": member.member_id, "role": member.role, "problems": []}
    record = CommitRecord(member.record_window)
    run = _MemberRun(member, layouts, config, device, member.formats(), hooks, hold)
    if member.role == "trainer":
        _run_trainer(run, pace, out, record)
    else:
        _run_inference(run, out, record)
    return out | record.report()


def _source_fill(run: _MemberRun) -> Callable[..., None]:
    """How a trainer fills its sources: random bytes may be NaN, which no quantized format
    holds, so finite values in a job with quantized destinations."""
    return fill_finite if run.formats else fill_pieces


def _weights_ahead(run: _MemberRun) -> dict[int, dict[str, torch.Tensor]]:
    """Every version's weights, made before the loop (``MemberSpec.weights_ahead``; else none)."""
    member, fill = run.member, _source_fill(run)
    ahead: dict[int, dict[str, torch.Tensor]] = {}
    for version in member.versions if member.weights_ahead else ():
        ahead[version] = allocate(run.layouts.source, member.layout_rank, fill=0, device=run.device)
        fill(run.layouts.source, member.layout_rank, ahead[version], seed=version)
    return ahead


def _new_weights(run: _MemberRun, tensors: dict[str, torch.Tensor], ahead: dict[int, dict[str, torch.Tensor]],
                 version: int) -> None:
    """Write ``version``'s weights into ``tensors`` (the training step's result)."""
    member, source = run.member, run.layouts.source
    if version in ahead:
        for name, t in tensors.items():
            t.copy_(ahead[version][name])
    elif member.delta_density is not None:
        new = version_buffers(source, member.layout_rank, version, density=member.delta_density, device=run.device)
        for name, t in tensors.items():
            t.copy_(new[name])
    else:
        _source_fill(run)(source, member.layout_rank, tensors, seed=version)


def _run_trainer(run: _MemberRun, pace: Pace | None, out: dict[str, Any], record: CommitRecord) -> None:
    """A trainer: publish every version (at most one in flight with ``async_publish``),
    recording each commit in ``record``; the loop's seconds and the stats go to ``out``."""
    member = run.member
    with ElasticRefit(run.config, run.layouts, hooks=run.hooks) as refit:
        if member.start_with:
            wait_for_epoch_members(run.config, member.start_with, member.start_timeout_s)
        tensors = allocate(run.layouts.source, member.layout_rank, fill=0, device=run.device)
        ahead = _weights_ahead(run)
        pending = None  # (version, handle, start) of the version in flight

        def committed(commit: Any, start: float) -> None:
            record.append({"version": commit.version, "epoch": commit.epoch, "seconds": time.monotonic() - start})
            if pace is not None:
                pace.committed(commit.version)

        loop_start = time.monotonic()
        for version in member.versions:
            time.sleep(member.pause_s)  # the training step
            if pending is not None:
                committed(pending[1].wait(), pending[2])
            if pace is not None:
                pace.wait_turn(version)
            _new_weights(run, tensors, ahead, version)
            start = time.monotonic()
            if member.async_publish:
                pending = (version, refit.publish(tensors, version, wait=False), start)
                continue
            committed(refit.publish(tensors, version), start)
        if pending is not None:
            committed(pending[1].wait(), pending[2])
        out["loop_s"] = time.monotonic() - loop_start  # every step and every commit
        if run.hold is not None:
            run.hold(refit)
        out["stats"] = dict(refit.stats)


def _version_check(run: _MemberRun, params: dict[str, torch.Tensor]) -> Callable[[int], list[str]]:
    """``check(version)``: what differs between ``params`` and ``version``'s weights (its
    delta data, its quantized bytes and scales, or its pattern cast as the refit casts it)."""
    member, destination = run.member, run.layouts.destination
    # tensors the trainers publish in another dtype (a refit casts them: layout.casts)
    cast_from = {name: src for name, (src, _) in source_casts(run.layouts.source, destination).items()}

    def check(version: int) -> list[str]:
        if member.delta_density is not None:
            return version_problems(destination, member.layout_rank, params, version, density=member.delta_density)
        if run.formats:
            return check_quantized(destination, run.formats, member.layout_rank, params, seed=version)
        return check_pieces(destination, member.layout_rank, params, seed=version, cast_from=cast_from)

    return check


def _run_inference(run: _MemberRun, out: dict[str, Any], record: CommitRecord) -> None:
    """An inference rank: wait for each newer version and check the one it serves (or the
    last only), recording each in ``record``; problems, unreachable versions and the stats
    go to ``out``."""
    member = run.member
    params = allocate(destination_format_layout(run.layouts.destination, run.formats), member.layout_rank, fill=0,
                      device=run.device)
    check_version = _version_check(run, params)
    with ElasticRefit(run.config, run.layouts, parameters=params, formats=run.formats or None,
                      hooks=run.hooks) as refit:
        seen = -1
        while seen < member.versions[-1]:  # each wait returns a newer version or times out
            try:
                version = refit.wait_for_version(seen + 1)
            except VersionUnreachable as exc:  # (a restarted TP rank) the next version reaches it
                out.setdefault("unreachable", []).append(exc.version)
                seen = max(seen, exc.version)
                continue
            with refit.weights() as serving:
                check = not member.check_last_only or serving >= member.versions[-1]
                problems = check_version(serving) if check else []
            record.append({"version": serving, "verified": not problems, "checked": check})
            out["problems"] += problems
            seen = max(seen, version)
        if run.hold is not None:
            run.hold(refit)
        out["stats"] = dict(refit.stats)
