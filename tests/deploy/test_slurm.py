"""deploy/slurm/refit.sbatch on a real one-node Slurm cluster started on this machine.

The module fixture installs Debian's Slurm and MUNGE packages when they are missing (the
test is skipped when apt cannot), writes a slurm.conf for this host into a temporary
folder, starts munged, slurmctld and slurmd in the foreground as child processes and waits
for the node to be idle. Teardown cancels what is left in the queue, stops the daemons by
pid, checks that no process of this cluster is left and removes the folder.

The test submits the job script with 2 trainers (tp=2) and 2 inference ranks (tp=2), kills
the trainer step with `scancel --signal=KILL` once version 2 is verified, and checks from
the job's output that the relaunched step carried on: every version committed on both
trainers and verified by both inference ranks. Slurm is never mocked.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from elastic_refit.testing.etcd import EtcdServerError, find_etcd_binary, free_ports
from elastic_refit.testing.processes import pid_alive

pytestmark = [pytest.mark.slurm, pytest.mark.etcd]

REPO_ROOT = Path(__file__).resolve().parents[2]
SBATCH = REPO_ROOT / "deploy" / "slurm" / "refit.sbatch"
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scancel", "sinfo", "scontrol")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
VERSIONS = 6
LINE = re.compile(r"^member_id=(?P<member>\S+) role=(?P<role>\S+) incarnation=(?P<incarnation>\S+) event=(?P<event>\S+) "
                  r"version=(?P<version>\d+)")


def _path() -> str:
    return os.pathsep.join(p for p in (os.environ.get("PATH", ""), SYSTEM_PATH) if p)


def _which(name: str) -> str | None:
    return shutil.which(name, path=_path())


def _install_packages() -> float:
    """Install Slurm and MUNGE from Debian when a binary is missing; the seconds it took.
    Skips the module when that is not possible here."""
    missing = [name for name in DAEMONS + CLIENTS if _which(name) is None]
    if not missing:
        return 0.0
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing) and installing it needs root on Linux")
    if _which("apt-get") is None:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing) and there is no apt-get")
    started = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "PATH": _path()}
    # The packages' maintainer scripts would start system-wide munge/slurm services; a
    # policy-rc.d that denies every start (as in Docker images) keeps them off.
    policy = Path("/usr/sbin/policy-rc.d")
    added_policy = not policy.exists()
    if added_policy:
        policy.write_text("#!/bin/sh\n# elastic-refit tests/deploy/test_slurm.py: no service starts\nexit 101\n")
        policy.chmod(0o755)
    try:
        install = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
        result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True, timeout=600)
            result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip(f"`apt-get install {' '.join(PACKAGES)}` did not finish within 10 minutes")
    finally:
        if added_policy:
            policy.unlink(missing_ok=True)
    if result.returncode != 0:
        tail = (result.stdout + result.stderr).strip().splitlines()[-5:]
        pytest.skip(f"`apt-get install {' '.join(PACKAGES)}` failed: {' | '.join(tail)}")
    still = [name for name in DAEMONS + CLIENTS if _which(name) is None]
    if still:
        pytest.skip(f"installed {' '.join(PACKAGES)} but {', '.join(still)} are still missing")
    return time.monotonic() - started


def _real_memory_mb() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return max(256, int(line.split()[1]) // 1024 // 2)
    return 1024


def _slurm_conf(root: Path, node: str, ctld_port: int, slurmd_port: int) -> str:
    cpus = os.cpu_count() or 1
    return f"""\
# A one-node cluster on loopback for tests/deploy/test_slurm.py (everything under {root}).
ClusterName=refit-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge-run/munge.socket
StateSaveLocation={root}/ctld
SlurmdSpoolDir={root}/slurmd
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in a container: track processes by parent pid, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
InactiveLimit=0
KillWait=2
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={_real_memory_mb()} State=UNKNOWN
PartitionName=refit Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return needle in fh.read().split(b"\0")
    except OSError:
        return False


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    node: str
    env: dict[str, str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def run(self, *args: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {result.returncode}: {result.stderr.strip()}"
                                 f"\n{self.logs()}")
        return result

    def logs(self, lines: int = 15) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace").strip().splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out)

    def start(self, name: str, args: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 - handed to the child
        try:
            self.procs[name] = subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()

    def check_running(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited {proc.returncode} at start\n{self.logs()}")

    def leftovers(self) -> list[int]:
        """Pids of processes started by this cluster: they all carry its SLURM_CONF."""
        needle = f"SLURM_CONF={self.conf}".encode()
        mine = os.getpid()
        return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != mine
                and pid_alive(int(p)) and _environ_has(int(p), needle)]


def _wait(predicate, timeout_s: float, what: str, cluster: SlurmCluster, poll_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        cluster.check_running()
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{cluster.logs()}")


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    install_s = _install_packages()
    try:
        find_etcd_binary()
    except EtcdServerError as exc:
        pytest.skip(str(exc))
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="refit-slurm-"))
    root.chmod(0o755)  # munged wants every folder above its socket searchable by all
    for sub in ("munge", "munge-run", "ctld", "slurmd", "log", "tmp", "state"):
        (root / sub).mkdir()
    (root / "munge").chmod(0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    node = socket.gethostname().split(".")[0]
    ctld_port, slurmd_port = free_ports(2)
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, node, ctld_port, slurmd_port))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ELASTIC_REFIT_", "REFIT_"))}
    env.update(SLURM_CONF=str(conf), PATH=_path())
    cluster = SlurmCluster(root=root, conf=conf, node=node, env=env)
    cluster.timings["install_s"] = install_s
    try:
        munge_args = [_which("munged"), "--foreground", f"--socket={root}/munge-run/munge.socket",
                      f"--key-file={key}", f"--log-file={root}/log/munged.log",
                      f"--pid-file={root}/munge/munged.pid", f"--seed-file={root}/munge/munged.seed"]
        cluster.start("munged", munge_args)
        _wait(lambda: (root / "munge-run" / "munge.socket").exists(), 10, "munged's socket", cluster, 0.05)
        cluster.start("slurmctld", [_which("slurmctld"), "-D", "-f", str(conf)])
        _wait(lambda: cluster.run("scontrol", "ping", check=False).stdout.count("UP"), 20,
              "slurmctld to answer", cluster, 0.1)
        cluster.start("slurmd", [_which("slurmd"), "-D", "-f", str(conf), "-N", node])

        def idle() -> bool:
            states = cluster.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split()
            return states == [node, "idle"]

        _wait(idle, 30, f"node {node} to be idle", cluster, 0.2)
        cluster.timings["cluster_start_s"] = time.monotonic() - started
        yield cluster
    finally:
        _teardown(cluster)


def _teardown(cluster: SlurmCluster) -> None:
    problems = []
    if "slurmctld" in cluster.procs and cluster.procs["slurmctld"].poll() is None:
        cluster.run("scancel", "--full", "--user", "root", check=False)  # this cluster's jobs only
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and cluster.run("squeue", "-h", check=False).stdout.strip():
            time.sleep(0.25)
    for name in reversed(list(cluster.procs)):
        proc = cluster.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                problems.append(f"{name} (pid {proc.pid}) ignored SIGTERM")
                proc.kill()
                proc.wait(timeout=5)
    left = cluster.leftovers()
    for pid in left:  # descendants of this cluster (slurmstepd, job tasks): ours to stop
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if left:
        problems.append(f"processes of the test cluster still running after teardown: {left}")
    shutil.rmtree(cluster.root, ignore_errors=True)
    assert not problems, "; ".join(problems)


def _job_state(slurm: SlurmCluster, job: str) -> dict[str, str]:
    out = slurm.run("scontrol", "show", "job", "-o", job, check=False).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def _events(text: str) -> list[tuple[int, str, str, int]]:
    """(line number, member id, event, version) of every line the workers printed."""
    found = []
    for number, line in enumerate(text.splitlines()):
        m = LINE.match(line)
        if m:
            found.append((number, m["member"], m["event"], int(m["version"])))
    return found


def test_refit_job_survives_a_killed_member_step(slurm: SlurmCluster) -> None:
    bindir = Path(sys.executable).parent
    env = {**slurm.env, "PATH": os.pathsep.join((str(bindir), slurm.env["PATH"])),
           "TMPDIR": str(slurm.root / "tmp"), "REFIT_STATE_DIR": str(slurm.root / "state"),
           "REFIT_KEEP_STATE": "1", "REFIT_VERSIONS": str(VERSIONS), "REFIT_PAUSE_S": "1",
           "REFIT_TRAINER_PARALLELISM": "tp=2", "REFIT_INFERENCE_PARALLELISM": "tp=2",
           "REFIT_ETCD_LISTEN": "127.0.0.1"}
    if not (bindir / "elastic-refit").exists():
        env["REFIT_CLI"] = f"{sys.executable} -m elastic_refit.cli"
    output = slurm.root / "job.out"
    started = time.monotonic()
    # 4 tasks on this small node: --overcommit lets them share its cores.
    submit = subprocess.run(["sbatch", "--parsable", "--ntasks=4", "--overcommit", f"--output={output}",
                             str(SBATCH)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert submit.returncode == 0, f"sbatch failed: {submit.stderr}\n{slurm.logs()}"
    job = submit.stdout.strip().split(";")[0]

    def read() -> str:
        return output.read_text(errors="replace") if output.exists() else ""

    def finished() -> bool:
        return _job_state(slurm, job).get("JobState") not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING")

    def version_2_verified() -> bool:
        if finished():
            raise AssertionError(f"job {job} ended before version 2 was verified:\n{read()[-4000:]}")
        return any(e[2] == "verified" and e[3] == 2 for e in _events(read()))

    _wait(version_2_verified, 90, "version 2 to be verified", slurm)
    steps = slurm.run("squeue", "-h", "-s", "-j", job, "-o", "%i %j").stdout.split("\n")
    trainer_steps = [s.split()[0] for s in steps if s.strip().endswith(" refit-trainer")]
    assert len(trainer_steps) == 1, f"expected one trainer step, got {steps}"
    killed = trainer_steps[0]
    killed_after = len(read().splitlines())
    slurm.run("scancel", "--signal=KILL", killed)
    kill_s = time.monotonic() - started

    _wait(finished, 150 - kill_s, f"job {job} to finish", slurm, 0.5)
    slurm.timings["job_s"] = time.monotonic() - started
    state = _job_state(slurm, job)
    text = read()
    assert (state.get("JobState"), state.get("ExitCode")) == ("COMPLETED", "0:0"), \
        f"job {job}: {state.get('JobState')} exit {state.get('ExitCode')}\n{text[-6000:]}"

    events = _events(text)
    assert not [e for e in events if e[2] != "committed" and e[2] != "verified"], text[-6000:]
    for member, event in (("trainer-0", "committed"), ("trainer-1", "committed"),
                          ("inference-0", "verified"), ("inference-1", "verified")):
        seen = {e[3] for e in events if e[1] == member and e[2] == event}
        assert seen == set(range(1, VERSIONS + 1)), f"{member} {event} {sorted(seen)}\n{text[-6000:]}"

    # The kill ended the step and the script relaunched it as a new step of the same job.
    relaunch = [n for n, line in enumerate(text.splitlines())
                if line.startswith("refit.sbatch: trainer step exited") and "relaunching" in line]
    assert relaunch, f"no relaunch of the trainer step after killing {killed}:\n{text[-6000:]}"
    starts = re.findall(rf"refit-member: start (trainer-\d) rank \d \(job {job} step (\d+) node ", text)
    step_ids = {step for _, step in starts}
    assert killed.split(".")[1] in step_ids and len(step_ids) == 2, f"trainer steps {starts}"
    # Versions nobody had committed at the kill were committed by the relaunched trainers.
    before = {e[3] for e in events if e[0] < killed_after and e[2] == "committed"}
    after = {(e[1], e[3]) for e in events if e[0] > relaunch[0] and e[2] == "committed"}
    new = set(range(1, VERSIONS + 1)) - before
    assert new and all((m, v) in after for m in ("trainer-0", "trainer-1") for v in new), \
        f"committed before the kill {sorted(before)}, after the relaunch {sorted(after)}"
    print(f"\nslurm timings: install {slurm.timings['install_s']:.1f}s, cluster start "
          f"{slurm.timings['cluster_start_s']:.1f}s, job {slurm.timings['job_s']:.1f}s "
          f"(kill of step {killed} at {kill_s:.1f}s)")
