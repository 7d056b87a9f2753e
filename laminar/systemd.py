"""`laminar-node systemd --host ID --out DIR CONFIG`: one unit file per role placed on a host.

The units carry the command's `--log-level` and `--set` overrides. Paths the sandbox below hides
(the interpreter, the checkout, the config, the workdir, model folders or datasets under /tmp,
or under /root for a non-root user) are warned about when the units are written (the same check
as `laminar-node check --systemd`): such units would not start.

Each unit runs the role in the foreground (`laminar-node role ...`), `Type=notify` (the shell sends
READY=1 after setup), `WatchdogSec` (the shell pings WATCHDOG=1 from its event loop, so a stuck
loop is restarted), `Restart=on-failure` (the shell exits 1 only on failure; 3, an operator's
Shutdown command, is a stop: `SuccessExitStatus=3`, `RestartPreventExitStatus=3`). Roles on the
broker's host order themselves after the broker unit. A `.target` groups the host's units.

Confinement (cluster.systemd in the config): every unit runs as a dedicated user (`laminar` by
default; the env role as root, which its namespace sandbox needs, unless configured otherwise,
but with only the capabilities that sandbox uses, ENV_CAPABILITIES, and `Delegate=yes` so that it
can make a cgroup per run on cgroup v2)
with UMask=0077 (stores, checkpoints and logs private to that user), NoNewPrivileges, a read-only
system (ProtectSystem=strict, home read-only) in which only the run's workdir, /dev/shm (weights)
and configured paths are writable, a private /tmp, a cache folder of its own (XDG_CACHE_HOME, for
compiled kernels), LimitNOFILE, restart backoff (RestartSteps/RestartMaxDelaySec where the
host's systemd has them, >= 254) and a start timeout per role (a rollout loading a large model
gets 1800 s unless its placement sets ready_timeout_s). Roles other than env also lose kernel
tunables, modules, logs, cgroups, clock and hostname, set-uid files and realtime scheduling.
Left open on purpose: devices (GPUs, RDMA) and address families (UCX), which vary by cluster.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from laminar.supervisor import ready_timeout_for

RESTART_STEPS_SINCE = 254  # systemd version that knows RestartSteps / RestartMaxDelaySec
# what the env role's sandbox needs of root (tests/unit/laminar/envs/test_sandbox_capabilities.py runs it with
# exactly these): unshare/mount/pivot_root, setuid/setgid/setgroups to the sandbox uid, chown of the
# scratch files, writing them into the scratch owned by that uid, signalling a run's processes
ENV_CAPABILITIES = ("CAP_SYS_ADMIN", "CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_KILL")
# the agent role's sandbox also brings up the loopback of its run's own network namespace (the
# door to the gateway): CAP_NET_ADMIN, used only inside that new namespace
SANDBOX_CAPABILITIES = {"env": ENV_CAPABILITIES, "agent": (*ENV_CAPABILITIES, "CAP_NET_ADMIN")}


def local_systemd_version() -> int | None:
    """The systemd version of this host (units are normally generated on the host that runs
    them), or None when systemd is not installed."""
    for tool in ("systemctl", "systemd-analyze"):
        exe = shutil.which(tool)
        if exe:
            try:
                out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            m = re.match(r"systemd (\d+)", out)
            if m:
                return int(m.group(1))
    return None


def unit_name(run: str, role: str, id: str) -> str:
    return f"laminar-{run}-{role}-{id}.service"


def _path(p: str) -> str:
    """A path as a unit-file value: `%` would start a systemd specifier."""
    return p.replace("%", "%%")


def _arg(a: str) -> str:
    """One ExecStart argument, quoted when it holds spaces or quotes (systemd splits on them)."""
    a = _path(a)
    if not re.search(r"[\s\"'\\]", a):
        return a
    return '"' + a.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _confinement(cfg, role: str, workdir: str, systemd_version: int | None) -> str:
    sd = cfg.cluster.systemd
    user = sd.role_users.get(role, sd.user)
    run_dir = Path(workdir, cfg.run.workdir)  # a relative workdir is relative to WorkingDirectory
    writable = " ".join("-" + _arg(str(p)) for p in [run_dir, "/dev/shm", *sd.read_write_paths])
    lines = [f"User={user}", "UMask=0077", "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=read-only",
             f"ReadWritePaths={writable}", "PrivateTmp=yes", f"CacheDirectory=laminar-{cfg.run.name}",
             f"Environment=XDG_CACHE_HOME=%C/laminar-{cfg.run.name}", f"LimitNOFILE={sd.limit_nofile}"]
    if systemd_version is None or systemd_version >= RESTART_STEPS_SINCE:
        lines += [f"RestartSteps={sd.restart_steps}", f"RestartMaxDelaySec={sd.restart_max_delay_s}"]
    else:
        lines.append(f"# RestartSteps/RestartMaxDelaySec need systemd >= {RESTART_STEPS_SINCE} (this host has "
                     f"{systemd_version}): restarts wait RestartSec each")
    if role in SANDBOX_CAPABILITIES:
        # Delegate: the unit's cgroup is the role's to write, so its sandbox can make a cgroup per run
        # (cgroup v2: it moves itself into a leaf and enables memory, pids and cpu for children,
        # laminar/envs/cgroups.py). The bounding set: root, but only what the sandbox needs
        # (namespaces and mounts, switching to the sandbox uid, owning the scratch files, killing
        # a run): no raw I/O, modules, ptrace, network administration, ... for whoever escapes it.
        lines += ["Delegate=yes", f"CapabilityBoundingSet={' '.join(SANDBOX_CAPABILITIES[role])}"]
    else:  # its sandbox mounts and unshares; everything else needs none of this
        lines += ["ProtectKernelTunables=yes", "ProtectKernelModules=yes", "ProtectKernelLogs=yes",
                  "ProtectControlGroups=yes", "ProtectClock=yes", "ProtectHostname=yes", "RestrictSUIDSGID=yes",
                  "RestrictRealtime=yes", "LockPersonality=yes", "SystemCallArchitectures=native"]
        if user != "root":
            lines.append("CapabilityBoundingSet=")
    return "\n".join(lines)


def render_units(cfg, config_path: str, host: str, python: str | None = None,
                 workdir: str | None = None, watchdog_s: int = 30,
                 systemd_version: int | None | str = "local", log_level: str = "info",
                 overrides: list[str] | tuple[str, ...] = ()) -> dict[str, str]:
    """`systemd_version`: of the host that will run the units ("local": this one's); `log_level`
    and the `--set` overrides go on every unit's command line."""
    python = python or sys.executable
    workdir = workdir or os.getcwd()
    if systemd_version == "local":
        systemd_version = local_systemd_version()
    config_abs = str(Path(config_path).resolve())
    run = cfg.run.name
    here = cfg.cluster.hosts[host].roles
    broker_here = cfg.cluster.broker.host == host
    units: dict[str, str] = {}
    target = f"laminar-{run}-{host}.target"
    for spec in here:
        after = "network-online.target"
        if broker_here and spec.role != "broker":
            after += " " + unit_name(run, "broker", "0")
        start_s = int(ready_timeout_for(spec.role, spec.ready_timeout_s))
        env_lines = "".join(f"Environment={k}={v}\n" for k, v in spec.env().items())  # gpus: CUDA_VISIBLE_DEVICES
        sets = [x for o in overrides for x in ("--set", o)]
        exec_start = " ".join(map(_arg, [python, "-m", "laminar.cli", "--log-level", log_level, "role", spec.role,
                                         "--id", spec.id, "--host", host, *sets, config_abs]))
        units[unit_name(run, spec.role, spec.id)] = f"""[Unit]
Description=Laminar {spec.role}.{spec.id} of run {run} on host {host}
After={after}
Wants=network-online.target
PartOf={target}

[Service]
Type=notify
NotifyAccess=main
WorkingDirectory={_path(workdir)}
ExecStart={exec_start}
Restart=on-failure
SuccessExitStatus=3
RestartPreventExitStatus=3
RestartSec=2
WatchdogSec={watchdog_s}
TimeoutStartSec={start_s}
TimeoutStopSec={int(cfg.cluster.shutdown_s) + 5}
KillSignal=SIGTERM
Environment=PYTHONUNBUFFERED=1
{env_lines}{_confinement(cfg, spec.role, workdir, systemd_version)}

[Install]
WantedBy={target}
"""
    wants = " ".join(unit_name(run, s.role, s.id) for s in here)
    units[target] = f"""[Unit]
Description=Laminar run {run}: every role on host {host}
Wants={wants}

[Install]
WantedBy=multi-user.target
"""
    return units


def write_units(units: dict[str, str], out: str) -> list[Path]:
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in units.items():
        p = d / name
        p.write_text(text)
        paths.append(p)
    return paths
