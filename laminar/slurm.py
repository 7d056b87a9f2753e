"""`laminar-node slurm CONFIG --out job.sbatch`: run a config's hosts on the nodes of a Slurm job.

The batch script asks for one node per host of the config (`--nodes`, one task each, whole
nodes, the GPUs through `--gpus-per-node`), and when the job starts:

1. writes the config once, into `<workdir>/slurm-<jobid>/`: the config as it was when the script
   was written (with its `--set` overrides, embedded in the script, so editing the file later
   does not change a queued job), with the job's nodes filled in (`python -m laminar.slurm
   resolve`): `SLURM_JOB_NODELIST`, expanded by `scontrol show hostnames`, maps onto the
   config's hosts in order (the first node runs the first host, ...). In a config of several
   hosts each host's `address`, and its `bind`/`metrics_bind` unless a wildcard, become its
   node's IP address; a config of one host runs as written (loopback works on one node);
2. starts `laminar-node start --host ID` on every node with `srun`, one task per node
   (`python -m laminar.slurm node` looks its node up in the mapping and becomes that command):
   one step for the nodes of the trainer's hosts, one for the rest;
3. ends when the trainer's step ends (the trainer reached max_iterations and its node stopped):
   the other step is then sent SIGTERM (`scancel --signal=TERM JOB.STEP`; a SIGTERM to `srun`
   itself would make it kill its tasks at once), so every `start` stops its roles in order.

A killed job (scancel, the time limit) sends SIGTERM to every task, and each `start` stops its
roles within `cluster.shutdown_s`; Slurm's KillWait (30 s by default) must exceed that, or the
roles are SIGKILLed. The Python interpreter, the checkout and the workdir must be on a
filesystem every node sees, and so must the cluster key (`laminar-node keygen` once).

The script is written 0700 and makes its job folder 0700 with 0600 files (`umask 077`): it holds
the config. A config holding a literal secret (a secret-named field: laminar/secrets.py) is
refused: secrets are references (`{env: NAME}`, exported to the job, or `{file: PATH}`).
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import socket
import sys
from pathlib import Path

import yaml

from laminar.config import ConfigError, UsageError, apply_overrides, parse_config, read_config_data
from laminar.secrets import literal_secrets

WILDCARDS = ("0.0.0.0", "::", "*", "")
MARK = "LAMINAR_CONFIG_END"


def expand_hostlist(expr: str) -> list[str]:
    """A Slurm host list (`node[01-03,07],gpu[1-2]-ib`) as names, in order, what `scontrol show
    hostnames` prints: a range keeps its first bound's zero padding; several brackets in one name
    are combined, the last varying fastest."""
    out: list[str] = []
    for item in _split_top(expr.strip()):
        names = [""]
        for m in re.finditer(r"([^\[]+)|\[([^\]]*)\]", item):
            if m.group(1) is not None:
                names = [n + m.group(1) for n in names]
                continue
            parts = []
            for rng in m.group(2).split(","):
                lo, _, hi = rng.partition("-")
                if not lo.isdigit() or (hi and not hi.isdigit()):
                    raise ValueError(f"bad host list range {rng!r} in {expr!r}")
                width = len(lo)
                parts += [str(i).zfill(width) for i in range(int(lo), int(hi or lo) + 1)]
            names = [n + p for n in names for p in parts]
        out += names
    return out


def _split_top(expr: str) -> list[str]:
    """`expr` split at the commas outside brackets."""
    items, depth, cur = [], 0, ""
    for ch in expr:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    return [i for i in [*items, cur] if i]


def map_hosts(hosts: list[str], nodes: list[str]) -> dict[str, str]:
    """Host id -> node name: the config's hosts in order on the job's nodes in order."""
    if len(nodes) < len(hosts):
        raise UsageError(f"the job has {len(nodes)} node(s) ({', '.join(nodes)}) for {len(hosts)} hosts "
                         f"({', '.join(hosts)}): submit it with --nodes={len(hosts)}")
    return dict(zip(hosts, nodes, strict=False))


def node_ip(node: str) -> str:
    """The IPv4 (else any) address `node` resolves to here; the name itself when it does not."""
    try:
        infos = socket.getaddrinfo(node, None, type=socket.SOCK_STREAM)
    except OSError:
        return node
    v4 = [i[4][0] for i in infos if i[0] == socket.AF_INET]
    return (v4 or [infos[0][4][0]])[0]


def resolve(data: dict, nodes: list[str], ip=node_ip) -> tuple[dict, dict[str, str]]:
    """The config data with the nodes filled in, and host id -> node."""
    hosts = list(data["cluster"]["hosts"])
    mapping = map_hosts(hosts, nodes)
    if len(hosts) > 1:
        for hid, node in mapping.items():
            h = data["cluster"]["hosts"][hid]
            addr = ip(node)
            h["address"] = addr
            for key in ("bind", "metrics_bind"):
                if h.get(key) is not None and h[key] not in WILDCARDS:
                    h[key] = addr
    return data, mapping


def trainer_hosts(cfg) -> list[str]:
    """The hosts whose end is the run's end: where the trainer ranks are (else every host)."""
    return sorted({h for h, _ in cfg.find("trainer")}, key=list(cfg.cluster.hosts).index) or list(cfg.cluster.hosts)


# -- the batch script --------------------------------------------------------------------------------
def add_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--out", required=True, help="the batch script to write (submit it with `sbatch FILE`)")
    s.add_argument("--gpus-per-node", type=int, default=None, help="GPUs to ask for on every node (default: the "
                   "most any host's placements name in `gpus`, none when they name none)")
    s.add_argument("--partition", default=None, help="#SBATCH --partition")
    s.add_argument("--account", default=None, help="#SBATCH --account")
    s.add_argument("--time", default=None, help="#SBATCH --time (e.g. 12:00:00)")
    s.add_argument("--chdir", default=None, help="working directory of the job (default: this one; relative "
                   "paths of the config are relative to it)")
    s.add_argument("--python", default=None, help="the interpreter every node runs (default: this one)")
    s.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                   help="one more #SBATCH option, e.g. --sbatch=--qos=high (repeatable)")


def gpus_per_node(cfg) -> int:
    most = 0
    for h in cfg.cluster.hosts.values():
        gpus = {g for s in h.roles for g in (s.gpus or [])}
        most = max(most, max(gpus) + 1 if gpus else 0)
    return most


def render_script(cfg, data: dict, config_path: str, *, gpus: int, chdir: str, python: str, argv: list[str],
                  partition: str | None = None, account: str | None = None, time_limit: str | None = None,
                  extra: list[str] = (), log_level: str = "info") -> str:
    hosts = list(cfg.cluster.hosts)
    workdir = Path(chdir, cfg.run.workdir).absolute()
    text = yaml.safe_dump(data, sort_keys=False)
    if MARK in text:
        raise UsageError(f"{config_path}: the config holds the text {MARK}, which ends the script's copy of it")
    sb = [f"--job-name=laminar-{cfg.run.name}", f"--nodes={len(hosts)}", "--ntasks-per-node=1", "--exclusive",
          "--mem=0", f"--chdir={chdir}", f"--output={workdir}/slurm-%j.out"]
    sb += [f"--gpus-per-node={gpus}"] * bool(gpus)
    sb += [f"--partition={partition}"] * bool(partition) + [f"--account={account}"] * bool(account)
    sb += [f"--time={time_limit}"] * bool(time_limit) + list(extra)
    gpu_arg = f" --gpus-per-node={gpus}" if gpus else ""
    lead = trainer_hosts(cfg)
    return f"""#!/bin/bash
# Laminar run {cfg.run.name}: hosts {' '.join(hosts)} of {config_path}
# on the {len(hosts)} node(s) of this job, in order.
# Written by: {' '.join(shlex.quote(x) for x in argv)}
# (write it again rather than edit it). The job ends when the trainer's host(s) {' '.join(lead)} finish.
{chr(10).join(f'#SBATCH {o}' for o in sb)}
set -euo pipefail
umask 077                   # the job folder and its files are the user's alone (0700, 0600)
PY={shlex.quote(python)}
JOB_DIR={shlex.quote(str(workdir))}/slurm-$SLURM_JOB_ID
mkdir -p -m 700 "$JOB_DIR"
export LAMINAR_LOG_LEVEL={shlex.quote(log_level)} PYTHONUNBUFFERED=1

# The config as it was when this script was written (overrides applied); the nodes go in below.
cat > "$JOB_DIR/config.in.yaml" <<'{MARK}'
{text}{MARK}

# The job's nodes, in order, onto the config's hosts, in order: $JOB_DIR/config.yaml, hosts.txt.
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
"$PY" -m laminar.slurm resolve "$JOB_DIR/config.in.yaml" --out "$JOB_DIR" --nodes "${{NODES[@]}}"
LEAD_NODES=$(cat "$JOB_DIR/lead-nodes")     # the nodes of the trainer's hosts
OTHER_NODES=$(cat "$JOB_DIR/other-nodes")
# One `laminar-node start --host ID` per node (`laminar.slurm node` picks its ID by node name).
STEP=(--ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" --cpu-bind=none --kill-on-bad-exit=0{gpu_arg})
NODE=("$PY" -m laminar.slurm node "$JOB_DIR")
count() {{ tr ',' '\\n' <<<"$1" | wc -l; }}
others=""
if [ -n "$OTHER_NODES" ]; then
  srun --job-name=laminar-others --nodelist="$OTHER_NODES" --nodes="$(count "$OTHER_NODES")" \\
    --ntasks="$(count "$OTHER_NODES")" "${{STEP[@]}}" "${{NODE[@]}}" &
  others=$!
fi
code=0
srun --nodelist="$LEAD_NODES" --nodes="$(count "$LEAD_NODES")" --ntasks="$(count "$LEAD_NODES")" \\
  "${{STEP[@]}}" "${{NODE[@]}}" || code=$?
if [ -n "$others" ]; then    # the run is over: SIGTERM to the other step, its nodes stop their roles in order
  step=$(squeue -h -s -j "$SLURM_JOB_ID" -o "%i %j" | awk '$2 == "laminar-others" {{print $1}}')
  if [ -n "$step" ]; then scancel --signal=TERM "$step" || true; fi
  wait "$others" || true
fi
exit "$code"
"""


def cmd_slurm(a) -> int:
    data = apply_overrides(read_config_data(a.config), a.set)
    cfg = parse_config(data, a.config)
    if leaks := literal_secrets(data):  # the script embeds the config: a secret there would be copied around
        raise UsageError(f"{a.config}: {', '.join(leaks)}: a secret is never written in the config (it would be "
                         "copied into the batch script and the job folder): give {env: VARIABLE} or {file: PATH} "
                         "(a 0600 file on every node) instead")
    chdir = str(Path(a.chdir or os.getcwd()).absolute())
    workdir = Path(chdir, cfg.run.workdir)
    workdir.mkdir(parents=True, exist_ok=True)  # Slurm writes the job's output there and creates no folder
    gpus = gpus_per_node(cfg) if a.gpus_per_node is None else a.gpus_per_node
    text = render_script(cfg, data, a.config, gpus=gpus, chdir=chdir, python=a.python or sys.executable,
                         argv=getattr(a, "argv", None) or ["laminar-node", *sys.argv[1:]], partition=a.partition,
                         account=a.account, time_limit=a.time, extra=a.sbatch,
                         log_level=getattr(a, "log_level", "info"))
    out = Path(a.out)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o700)  # the user's alone from its first byte
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o700)
        f.write(text)
    print(f"wrote {out}: {len(cfg.cluster.hosts)} node(s){f', {gpus} GPU(s) each' if gpus else ''}; "
          f"submit it with `sbatch {out}` (output: {workdir}/slurm-<jobid>.out)")
    return 0


# -- what the batch script runs -------------------------------------------------------------------------
def main_resolve(a) -> int:
    data = read_config_data(a.config)
    data, mapping = resolve(data, a.nodes)
    cfg = parse_config(data, a.config)
    out = Path(a.out)
    (out / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    (out / "hosts.txt").write_text("".join(f"{n} {h}\n" for h, n in mapping.items()))
    lead = [mapping[h] for h in trainer_hosts(cfg)]
    (out / "lead-nodes").write_text(",".join(lead) + "\n")
    (out / "other-nodes").write_text(",".join(n for n in mapping.values() if n not in lead) + "\n")
    for h, n in mapping.items():
        print(f"{n}: laminar-node start --host {h} {out / 'config.yaml'}")
    return 0


def main_node(a) -> int:
    """On one node of the job: become `laminar-node start --host ID` for this node's host."""
    job = Path(a.job_dir)
    mapping = dict(line.split() for line in (job / "hosts.txt").read_text().splitlines() if line.strip())
    me = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    host = mapping.get(me)
    if host is None:
        raise UsageError(f"node {me} is not one of the job's nodes in {job / 'hosts.txt'}: {sorted(mapping)}")
    argv = [sys.executable, "-m", "laminar.cli", "start", "--host", host, "--plain", str(job / "config.yaml")]
    sys.stdout.flush()
    os.execv(sys.executable, argv)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m laminar.slurm", description="the steps of a Laminar batch script")
    sp = ap.add_subparsers(dest="cmd", required=True)
    s = sp.add_parser("resolve", help="write config.yaml (the job's nodes filled in) and hosts.txt")
    s.add_argument("config")
    s.add_argument("--out", required=True)
    s.add_argument("--nodes", nargs="+", required=True, help="the job's nodes, in order")
    s.set_defaults(fn=main_resolve)
    s = sp.add_parser("node", help="exec `laminar-node start --host ID` for this node")
    s.add_argument("job_dir")
    s.set_defaults(fn=main_node)
    a = ap.parse_args(argv)
    try:
        return a.fn(a)
    except (ConfigError, UsageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
