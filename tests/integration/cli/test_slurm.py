"""The Slurm launcher for real (laminar/slurm.py): Slurm from Debian's packages (slurmctld and two
slurmd on this machine, nodes `<hostname>` and `localhost`, munge for authentication, all in a
private folder on free ports), the batch script of `laminar-node slurm` submitted with `sbatch`:

- a job of the smoke config on two nodes (h0: the cluster, h1: one more role) trains to its
  last version and ends by itself (exit 0:0): the trainer's node finishes, the other node's
  step gets SIGTERM and stops its role in order;
- a cancelled job stops every role in order (SIGTERM to each `start`, which stops its roles
  within cluster.shutdown_s: none is SIGKILLed, each logs `role_stopped`).

Skipped, with the reason, where Slurm cannot be installed (not root, no apt-get, no network) or
its daemons do not start."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from laminar.testing.procs import free_port
from tests.integration.cluster_files import echo_cluster

pytestmark = pytest.mark.timeout(600)
CLI = [sys.executable, "-m", "laminar.cli"]
PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
TOOLS = ["slurmctld", "slurmd", "sbatch", "scancel", "scontrol", "sinfo", "munged"]


def _which(tool: str) -> str | None:
    return shutil.which(tool) or next((p for p in (f"/usr/sbin/{tool}", f"/usr/bin/{tool}") if os.path.exists(p)),
                                      None)


def install_slurm() -> str | None:
    """None when Slurm's tools are there (installed now if need be), else why they are not."""
    if all(_which(t) for t in TOOLS):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "Slurm is not installed, and installing it needs root and apt-get (Debian's slurmctld, slurmd, munge)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]
    r = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    if r.returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, env=env, timeout=600)
        r = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    if r.returncode != 0 or not all(_which(t) for t in TOOLS):
        return f"apt-get install {' '.join(PACKAGES)} failed: {(r.stderr or r.stdout).strip()[-300:]}"
    return None


CONF = """ClusterName=laminartest
SlurmctldHost={node}
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=30
MinJobAge=600
NodeName={node} NodeHostname={node} Port={port0} CPUs={cpus} State=UNKNOWN
NodeName=localhost NodeHostname={node} Port={port1} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """munged, slurmctld and two slurmd (two nodes on this machine) of one test session, in a
    private folder; each daemon ended by its pid."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="laminar-slurm-"))
        self.dir.chmod(0o755)   # munged (user munge) must reach its socket folder
        self.node = socket.gethostname().split(".")[0]
        self.env = {**os.environ, "SLURM_CONF": str(self.dir / "slurm.conf")}
        self.procs: list[subprocess.Popen] = []

    def start(self) -> str | None:
        """None when the node is idle, else why it is not."""
        mdir = self.dir / "munge"
        mdir.mkdir(mode=0o755)
        shutil.chown(mdir, "munge", "munge")
        key = mdir / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        shutil.chown(key, "munge", "munge")
        (self.dir / "state").mkdir()
        (self.dir / "slurm.conf").write_text(CONF.format(node=self.node, dir=self.dir, ctld_port=free_port(),
                                                         port0=free_port(), port1=free_port(),
                                                         cpus=os.cpu_count() or 1))
        self._run([_which("munged"), "-F", f"--socket={mdir}/munge.sock", f"--key-file={key}",
                   f"--pid-file={mdir}/munged.pid", f"--log-file={mdir}/munged.log", f"--seed-file={mdir}/seed"],
                  user="munge", group="munge", extra_groups=[])
        if not self._wait(lambda: (mdir / "munge.sock").exists(), 30):
            return f"munged did not start: {self._tail(mdir / 'munged.log')}"
        conf = str(self.dir / "slurm.conf")
        self._run([_which("slurmctld"), "-D", "-i", "-f", conf])
        for node in (self.node, "localhost"):   # two nodes on this machine (slurmd -N)
            self._run([_which("slurmd"), "-D", "-N", node, "-f", conf], name=f"slurmd-{node}")
        if not self._wait(lambda: self.sinfo() == "idle\nidle", 60):
            return (f"the two-node Slurm cluster did not come up (sinfo: {self.sinfo()!r}): "
                    f"{self._tail(self.dir / 'slurmctld.log')} {self._tail(self.dir / f'slurmd-{self.node}.log')}")
        return None

    def _run(self, argv, name: str | None = None, **kw) -> None:
        out = open(self.dir / f"{name or Path(argv[0]).name}.out", "w")
        self.procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                           start_new_session=True, **kw))

    @staticmethod
    def _wait(pred, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if pred():
                return True
            time.sleep(0.5)  # polling daemons that offer no readiness handshake
        return False

    @staticmethod
    def _tail(path: Path) -> str:
        return path.read_text()[-400:] if path.exists() else f"(no {path.name})"

    def sinfo(self) -> str:
        """The state of each node, one per line (`sinfo -N`)."""
        r = subprocess.run([_which("sinfo"), "-h", "-N", "-o", "%T"], capture_output=True, text=True,
                           env=self.env, timeout=30)
        return r.stdout.strip()

    def sbatch(self, script: Path, cwd: Path) -> str:
        r = subprocess.run([_which("sbatch"), "--parsable", str(script)], capture_output=True, text=True,
                           env=self.env, cwd=cwd, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        r = subprocess.run([_which("scontrol"), "show", "job", "-o", job_id], capture_output=True, text=True,
                           env=self.env, timeout=30)
        return dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)

    def wait_job(self, job_id: str, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(1.0)  # polling the controller: the job's state has no push notification
        raise AssertionError(f"job {job_id} not {states} after {timeout} s: {self.job(job_id)}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm_cluster():
    if (why := install_slurm()) is not None:
        pytest.skip(why)
    c = SlurmCluster()
    try:
        if (why := c.start()) is not None:
            pytest.skip(why)
        yield c
    finally:
        c.stop()


def write_script(path: Path, cwd: Path) -> Path:
    out = cwd / "job.sbatch"
    r = subprocess.run([*CLI, "slurm", str(path), "--out", str(out), "--chdir", str(cwd)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return out


def role_logs(run: Path) -> dict[str, list[dict]]:
    out = {}
    for log in sorted((run / "logs").glob("*.log")):
        out[log.stem] = [json.loads(ln) for ln in log.read_text().splitlines() if ln.startswith("{")]
    return out


def test_a_cancelled_slurm_job_stops_every_role_in_order(slurm_cluster, tmp_path):
    path, _ = echo_cluster(tmp_path, n_echo=2)
    job = slurm_cluster.sbatch(write_script(path, tmp_path), tmp_path)
    slurm_cluster.wait_job(job, ("RUNNING",), 120)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:   # every role up: `status` listens a second for heartbeats
        r = subprocess.run([*CLI, "status", str(path), "--json", "--wait", "1.0"], capture_output=True, text=True,
                           timeout=60)
        if r.returncode == 0:
            break
    assert r.returncode == 0, r.stdout + r.stderr
    pids = [v["pid"] for v in json.loads(r.stdout).values()]
    subprocess.run([shutil.which("scancel") or "/usr/bin/scancel", job], env=slurm_cluster.env, check=True,
                   timeout=30)
    info = slurm_cluster.wait_job(job, ("CANCELLED", "COMPLETED", "FAILED"), 120)
    assert info["JobState"] == "CANCELLED", info
    out = (tmp_path / "run" / f"slurm-{job}.out").read_text()
    assert "child_killed_after_deadline" not in out, out
    logs = role_logs(tmp_path / "run")
    assert sorted(logs) == ["broker.0", "echo.0", "echo.1"], sorted(logs)
    for key, events in logs.items():
        assert any(e.get("event") == "role_stopped" for e in events), (key, events[-3:])
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2], pid


@pytest.mark.slow
@pytest.mark.vllm
def test_a_slurm_job_of_the_smoke_config_trains_and_ends_with_the_trainer(slurm_cluster, tmp_path, tiny):
    pytest.importorskip("vllm")
    import yaml

    from laminar.testing.local_cluster import write_local_cluster
    path = write_local_cluster(tmp_path, tiny, iterations=2, rollouts=1, name="slurm")
    cfg = yaml.safe_load(path.read_text())   # a second host: one more role, on the job's second node
    cfg["cluster"]["hosts"]["h1"] = {"address": "127.0.0.1", "bind": "127.0.0.1",
                                     "roles": [{"role": "echo", "port": free_port()}]}
    cfg["roles"]["echo"] = {"interval_s": 0.5}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    script = write_script(path, tmp_path)
    assert "#SBATCH --nodes=2" in script.read_text()
    job = slurm_cluster.sbatch(script, tmp_path)
    info = slurm_cluster.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 540)
    run = tmp_path / "run"
    out = (run / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out[-3000:]
    assert "trainer finished: stopping the cluster" in out, out[-3000:]
    assert json.loads((run / "summary.json").read_text())["iterations"] == 2
    nodes = sorted([slurm_cluster.node, "localhost"])            # scontrol show hostnames: sorted
    hosts = (run / f"slurm-{job}" / "hosts.txt").read_text().split()
    assert hosts == [nodes[0], "h0", nodes[1], "h1"], hosts
    echo = role_logs(run)["echo.0"]
    assert any(e.get("event") == "role_stopped" for e in echo), echo[-3:]   # stopped by SIGTERM, in order
    killed = [e for e in map(_json, out.splitlines()) if e.get("event") == "child_killed_after_deadline"]
    assert not [e for e in killed if e.get("child") == "echo.0"], killed


def _json(line: str) -> dict:
    try:
        return json.loads(line) if line.startswith("{") else {}
    except ValueError:
        return {}
