"""`laminar-node systemd --host ID --out DIR CONFIG`: one unit file per role placed on a host.

Each unit runs the role in the foreground (`laminar-node role ...`), `Type=notify` (the shell sends
READY=1 after setup), `WatchdogSec` (the shell pings WATCHDOG=1 from its event loop, so a stuck
loop is restarted), `Restart=on-failure` (the shell exits 1 only on failure). Roles on the
broker's host order themselves after the broker unit. A `.target` groups the host's units.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path


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


def render_units(cfg, config_path: str, host: str, python: str | None = None,
                 workdir: str | None = None, watchdog_s: int = 30) -> dict[str, str]:
    python = python or sys.executable
    workdir = workdir or os.getcwd()
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
        units[unit_name(run, spec.role, spec.id)] = f"""[Unit]
Description=Laminar {spec.role}.{spec.id} of run {run} on host {host}
After={after}
Wants=network-online.target
PartOf={target}

[Service]
Type=notify
NotifyAccess=main
WorkingDirectory={_path(workdir)}
ExecStart={" ".join(map(_arg, [python, "-m", "laminar.cli", "role", spec.role, "--id", spec.id, "--host", host, config_abs]))}
Restart=on-failure
RestartSec=2
WatchdogSec={watchdog_s}
TimeoutStartSec=300
TimeoutStopSec={int(cfg.cluster.shutdown_s) + 5}
KillSignal=SIGTERM
Environment=PYTHONUNBUFFERED=1

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
