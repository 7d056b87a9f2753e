"""The Slurm launcher's logic (laminar/slurm.py): host lists expand as Slurm expands them, the
job's nodes map onto the config's hosts in order, and the batch script, run by bash with
stand-ins for `scontrol` and `srun`, writes the config once and starts one step for the
trainer's nodes and one for the rest, ending with the trainer's. The real thing, under a real
slurmctld and slurmd, is tests/integration/cli/test_slurm.py."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml

from laminar import slurm
from laminar.config import UsageError, parse_config
from laminar.slurm import expand_hostlist, render_script, resolve

CASES = {
    "node[01-03,07]": ["node01", "node02", "node03", "node07"],
    "vm": ["vm"],
    "a1,b[2-3]": ["a1", "b2", "b3"],
    "n[8-10]": ["n8", "n9", "n10"],
    "gpu[1-2]-ib[0-1]": ["gpu1-ib0", "gpu1-ib1", "gpu2-ib0", "gpu2-ib1"],
    "rack1-[009-011],x": ["rack1-009", "rack1-010", "rack1-011", "x"],
}


@pytest.mark.parametrize("expr", sorted(CASES))
def test_host_lists_expand_as_slurm_expands_them(expr):
    assert expand_hostlist(expr) == CASES[expr]
    if shutil.which("scontrol"):   # where Slurm is installed, it agrees
        out = subprocess.run(["scontrol", "show", "hostnames", expr], capture_output=True, text=True, timeout=30)
        if out.returncode == 0:
            assert out.stdout.split() == CASES[expr]


def cluster(hosts: int, bind="0.0.0.0") -> dict:
    hs = {f"h{i}": {"address": f"10.9.0.{i}", "bind": bind,
                    "roles": [{"role": "echo", "id": str(i), "port": 5600 + i}]} for i in range(hosts)}
    hs["h0"]["roles"].insert(0, {"role": "broker"})
    return {"run": {"name": "s", "workdir": "runs/s"},
            "cluster": {"keys_dir": None, "broker": {"host": "h0"}, "hosts": hs}}


def test_the_jobs_nodes_map_onto_the_hosts_in_order():
    nodes = expand_hostlist("node[01-03,07]")
    data, mapping = resolve(cluster(4), nodes, ip=lambda n: f"192.168.0.{int(n[-2:])}")
    assert mapping == {"h0": "node01", "h1": "node02", "h2": "node03", "h3": "node07"}
    hosts = data["cluster"]["hosts"]
    assert [hosts[h]["address"] for h in mapping] == ["192.168.0.1", "192.168.0.2", "192.168.0.3", "192.168.0.7"]
    assert all(h["bind"] == "0.0.0.0" for h in hosts.values())           # a wildcard stays
    data, _ = resolve(cluster(2, bind="10.9.0.5"), ["a", "b", "c"], ip=lambda n: f"ip-{n}")
    assert [h["bind"] for h in data["cluster"]["hosts"].values()] == ["ip-a", "ip-b"]  # an interface follows its node
    parse_config(data)
    one, mapping = resolve(cluster(1, bind="127.0.0.1"), ["vm"], ip=lambda n: "x")
    assert mapping == {"h0": "vm"} and one["cluster"]["hosts"]["h0"]["address"] == "10.9.0.0"  # one host: as written
    with pytest.raises(UsageError, match="the job has 2 node.* for 3 hosts"):
        resolve(cluster(3), ["a", "b"])


def config_with_trainer(tmp_path) -> dict:
    d = cluster(3)
    d["cluster"]["hosts"]["h1"]["roles"].append({"role": "trainer", "port": 5700, "gpus": [0, 1, 2, 3]})
    d["roles"] = {"trainer": {"model_dir": "models/x"}}
    d["run"]["workdir"] = str(tmp_path / "run")
    return d


FAKE_SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] && printf 'node01\\nnode02\\nnode07\\n'
"""
FAKE_SQUEUE = """#!/bin/bash
printf '42.0 laminar-others\\n42.1 python\\n42.batch batch\\n'
"""
FAKE_SCANCEL = """#!/bin/bash
echo "scancel $*" >> "$LOG"
"""
# srun: note its nodes and run the task once per node, as that node (what laminar.slurm node reads)
FAKE_SRUN = """#!/bin/bash
nodes=""; for a in "$@"; do case "$a" in --nodelist=*) nodes="${a#--nodelist=}";; esac; done
echo "srun $*" >> "$LOG"
cmd=(); seen=0; for a in "$@"; do if [ $seen = 1 ] || [[ "$a" != --* ]]; then seen=1; cmd+=("$a"); fi; done
for n in ${nodes//,/ }; do SLURMD_NODENAME=$n "${cmd[@]}"; done
"""


def test_the_batch_script_runs_one_start_per_node_and_ends_with_the_trainer(tmp_path, monkeypatch):
    data = config_with_trainer(tmp_path)
    cfg = parse_config(data, "c.yaml")
    script = render_script(cfg, data, "c.yaml", gpus=slurm.gpus_per_node(cfg), chdir=str(tmp_path),
                           python=sys.executable, argv=["laminar-node", "slurm", "c.yaml", "--out", "job.sbatch"])
    assert "#SBATCH --nodes=3" in script and "#SBATCH --gpus-per-node=4" in script and "--exclusive" in script
    assert "scontrol show hostnames \"$SLURM_JOB_NODELIST\"" in script and "srun " in script
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN), ("squeue", FAKE_SQUEUE),
                       ("scancel", FAKE_SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    # `laminar.slurm node` would exec `laminar-node start`; here a stand-in records which host it got
    shim = tmp_path / "py"
    shim.write_text(f"#!/bin/bash\nif [ \"$1 $2 $3\" = \"-m laminar.slurm node\" ]; then\n"
                    f"  echo \"$SLURMD_NODENAME start --host $(grep \"^$SLURMD_NODENAME \" \"$4/hosts.txt\" | "
                    f"cut -d' ' -f2)\" >> \"$LOG\"; exit 0; fi\nexec {sys.executable} \"$@\"\n")
    shim.chmod(0o755)
    job = tmp_path / "job.sbatch"
    job.write_text(script.replace(f"PY={sys.executable}", f"PY={shim}"))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "node[01-02,07]", "SLURM_CPUS_ON_NODE": "8", "LOG": str(tmp_path / "log"),
           "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run(["bash", str(job)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    log = (tmp_path / "log").read_text().splitlines()
    srun = [ln for ln in log if ln.startswith("srun ")]
    assert len(srun) == 2 and any("--nodelist=node02 " in ln for ln in srun), log      # h1 holds the trainer
    assert any("--job-name=laminar-others --nodelist=node01,node07 --nodes=2" in ln for ln in srun), log
    assert "scancel --signal=TERM 42.0" in log, log          # the run over: SIGTERM to the other step
    assert all("--gpus-per-node=4" in ln and "--ntasks-per-node=1" in ln for ln in srun), log
    assert sorted(ln for ln in log if " start " in ln) == ["node01 start --host h0", "node02 start --host h1",
                                                          "node07 start --host h2"]
    written = yaml.safe_load((tmp_path / "run" / "slurm-42" / "config.yaml").read_text())
    assert [h["address"] for h in written["cluster"]["hosts"].values()] == [slurm.node_ip(n) for n in
                                                                            ("node01", "node02", "node07")]


def test_node_step_becomes_start_for_its_host(tmp_path, monkeypatch):
    (tmp_path / "hosts.txt").write_text("node01 h0\nnode02 h1\n")
    seen = []
    monkeypatch.setattr(os, "execv", lambda exe, argv: seen.append(argv))
    monkeypatch.setenv("SLURMD_NODENAME", "node02")
    slurm.main_node(SimpleNamespace(job_dir=str(tmp_path)))
    assert seen[0][-5:] == ["start", "--host", "h1", "--plain", str(tmp_path / "config.yaml")]
    monkeypatch.setenv("SLURMD_NODENAME", "node09")
    with pytest.raises(UsageError, match="node node09 is not one of the job's nodes"):
        slurm.main_node(SimpleNamespace(job_dir=str(tmp_path)))


def test_the_slurm_command_writes_the_script_with_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config_with_trainer(tmp_path)))
    out = tmp_path / "job.sbatch"
    r = subprocess.run([sys.executable, "-m", "laminar.cli", "slurm", str(path), "--out", str(out), "--time",
                        "1:00:00", "--set", "run.name=renamed"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "#SBATCH --time=1:00:00" in text and "#SBATCH --job-name=laminar-renamed" in text
    assert "name: renamed" in text and os.access(out, os.X_OK)
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
