"""Writes a temporary cluster config (broker + echo roles, free ports, a cluster key) for tests."""
from __future__ import annotations

from pathlib import Path

import yaml
from laminar.bus.auth import generate_keys

from laminar.testing.procs import free_port


def echo_cluster(tmp: Path, n_echo: int = 1, keys: bool = True) -> tuple[Path, dict]:
    if keys:
        generate_keys(tmp / "keys")
    ports = {"pub": free_port(), "sub": free_port(), **{f"echo.{i}": free_port() for i in range(n_echo)}}
    cfg = {
        "run": {"name": "t", "workdir": str(tmp / "run")},
        "cluster": {
            "keys_dir": str(tmp / "keys") if keys else None,
            "heartbeat_s": 0.2,
            "shutdown_s": 5,
            "broker": {"host": "h0", "pub_port": ports["pub"], "sub_port": ports["sub"]},
            "hosts": {
                "h0": {
                    "address": "127.0.0.1",
                    "bind": "127.0.0.1",
                    "roles": [{"role": "broker"}]
                    + [{"role": "echo", "id": str(i), "port": ports[f"echo.{i}"]} for i in range(n_echo)],
                }
            },
        },
        "roles": {"echo": {"interval_s": 0.1}},
    }
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, ports
