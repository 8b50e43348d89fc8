"""``ElasticRefit`` in colocated mode end to end (issue 36): trainer and inference members as
processes sharing GPU 0 (it stands for one host's GPUs), ``same_host="ipc"``, a real etcd,
faults through the chaos machinery and the chaos oracle's verdict (nothing torn, lost, hung
or leaked, CUDA IPC mappings included; every served version bit-exact).

Two shapes of one host:

- colocated (a hybrid engine): trainers and inference ranks in one domain, so every byte of
  a refit is a direct read of the trainers' memory; the communicator (nccl4py) carries the
  signals and votes only;
- two domains on the host: trainer -> inference bytes cross domains over nccl4py, and the
  inference replicas fan out what they received to each other over IPC (a reader maps a
  peer that received its bytes in the same refit).

Faults: an inference rank SIGKILLed mid-refit (it reads, or is read from), a trainer killed
while its memory is mapped by its readers. After each, the next version commits. Leaks: the
oracle fails a member that kept another process's memory mapped after its close; here the
survivors' live GPU tensors return to where they were before the member, and a killed
process holds no GPU memory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess

import pytest
from elastic_refit.chaos.faults import FaultPlan, Scenario
from elastic_refit.chaos.runner import ChaosRun

from tests.gpu.conftest import chaos_root

pytestmark = [pytest.mark.gpu, pytest.mark.etcd, pytest.mark.chaos]

BACKEND = "nccl4py" if importlib.util.find_spec("nccl") is not None else "nccl"
RESULTS = os.environ.get("ELASTIC_REFIT_CHAOS_RESULTS")
IPC = {"same_host": "ipc"}
COLOCATED = {**IPC, "domain": "host-0"}  # one domain: a hybrid engine's trainers and engines
SHAPES = {"colocated": COLOCATED, "two_domains": IPC}
_RESULTS: list = []  # every trial of the module, for the leak test at its end


@pytest.fixture(scope="module")
def run():
    chaos = ChaosRun(deadline_s=90.0, backend=BACKEND, keep_logs=bool(os.environ.get("ELASTIC_REFIT_CHAOS_KEEP_LOGS")),
                     **chaos_root("colocated_chaos-"))
    yield chaos
    assert chaos.close() == [], "processes outlived the run"


def _scenario(name: str, plan: FaultPlan, shape: str, *, versions: int = 3) -> Scenario:
    fault = plan.faults[0] if plan.faults else None
    return Scenario(name=name, victim=fault.role if fault else "none", fault=fault.kind if fault else "none",
                    phase=fault.label if fault else "-", plan=plan, seed=0, versions=versions, num_inference=2,
                    member_config=SHAPES[shape])


def _events(result, event: str, prefix: str = "") -> list[dict]:
    return [e for inc, per in result.evidence.logs.items() if inc.startswith(prefix) for e in per
            if e.get("event") == event]


def _check(result, *, mapped: bool = True) -> None:
    """The oracle's verdict, every version committed, and (``mapped``) that the bytes moved
    over IPC: some rank shared its buffers and some inference rank mapped a peer's."""
    _RESULTS.append(result)
    if RESULTS:
        with open(RESULTS, "a") as fh:
            fh.write(json.dumps({**result.to_json(), "backend": BACKEND, "same_host": "ipc"}) + "\n")
    assert result.verdict.passed, [f"{v.category}: {v.detail}" for v in result.verdict.violations]
    assert result.verdict.faults_fired == len(result.scenario.plan.faults)
    committed = set(result.evidence.committed)
    assert set(range(1, result.scenario.versions + 1)) <= committed, sorted(committed)
    # The bytes moved over IPC: the trainers (and fan-out sources) shared their buffers, the
    # inference ranks mapped them.
    if mapped:
        assert _events(result, "transport.ipc.shared"), "no rank shared its buffers over CUDA IPC"
        assert _events(result, "transport.ipc.mapped", "i"), "no inference rank mapped a peer's memory"


def _received_over_the_communicator(result) -> int:
    """Bytes the inference ranks received through the communicator (direct reads excluded)."""
    return sum(e.get("recv_bytes", 0) for e in _events(result, "transport.executor.done", "i"))


def test_colocated_versions_commit_bit_exact_over_ipc(run):
    result = run.run_trial(_scenario("colocated", FaultPlan(), "colocated", versions=4))
    _check(result)
    # One domain: every refit byte is a direct read; nccl4py carried signals and votes only.
    assert _received_over_the_communicator(result) == 0
    done = _events(result, "transport.executor.done", "i")
    assert len(done) >= 2 * 4, f"{len(done)} inference refits for 4 versions on 2 ranks"


def test_two_domains_on_one_host_fan_out_over_ipc(run):
    result = run.run_trial(_scenario("two-domains", FaultPlan(), "two_domains"))
    _check(result)
    assert _received_over_the_communicator(result) > 0  # the cross-domain bytes, over nccl4py


@pytest.mark.parametrize("shape", ["colocated", "two_domains"])
def test_an_inference_rank_killed_mid_refit_and_the_next_version_commits(run, shape):
    """Colocated: i1 dies as it reads the trainers' memory (before its second operation of
    version 2: its signal or its mapping). Two domains: i1 is also the fan-out source of i0,
    which may hold i1's memory mapped when it dies."""
    plan = FaultPlan().kill(role="inference", rank=1, at="transfer", version=2, chunk=1)
    result = run.run_trial(_scenario(f"{shape}-inference-kill", plan, shape))
    # Two domains: the inference ranks map each other only for fan-outs, and whether a
    # version fans out depends on who had joined when it moved (H100, 2026-12-06: passed
    # alone, and in the full GPU suite every version committed bit-exact with no mapping
    # by an inference rank). The no-fault test above asserts the fan-out over IPC.
    _check(result, mapped=shape == "colocated")


def test_a_trainer_killed_while_its_memory_is_mapped(run):
    """t0's memory is mapped by its readers since version 1 (mappings last the epoch); it
    dies as version 2 starts: the readers' refit fails, they unmap a dead process's memory,
    and t1 (a replica) brings version 2 and 3 in the next epoch."""
    plan = FaultPlan().kill(role="trainer", rank=0, at="transfer", version=2, chunk=0)
    result = run.run_trial(_scenario("colocated-trainer-kill", plan, "colocated"))
    _check(result)


def _gpu_pids() -> set[int] | None:
    """Processes holding GPU memory, as nvidia-smi sees them (None: no nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return None
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return {int(x) for x in out.split() if x.strip().isdigit()}
    return None


def test_nothing_leaked(run):
    """After the trials above: no member kept another process's memory mapped (each report
    says so; the oracle checked it too), every survivor's live GPU tensors returned to what
    they were before it ran, and a killed process holds no GPU memory."""
    assert _RESULTS, "run the trials of this module first (file order)"
    measured = 0
    for result in _RESULTS:
        for incarnation, report in result.evidence.reports.items():
            assert report.get("leftover_ipc_mappings") == [], (incarnation, report.get("leftover_ipc_mappings"))
            before, after = report.get("cuda_allocated_before"), report.get("cuda_allocated_after")
            # A worker's first member also makes the process's one-time state (CUDA, NCCL,
            # kernels): the later members of a worker are the measure.
            if before is not None:
                measured += 1
                assert after == before, f"{incarnation} left {after - before} bytes of live GPU tensors"
    assert measured, "no member ran in a worker that had used the GPU before"
    victims = {f["pid"] for r in _RESULTS for f in r.evidence.faults if f.get("kind") == "kill"}
    pids = _gpu_pids()
    live = run.owned_pids()
    if pids is not None and pids & live:  # nvidia-smi sees this PID namespace
        assert not pids & victims, f"killed processes {sorted(pids & victims)} still hold GPU memory"
