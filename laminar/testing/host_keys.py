"""Scoped key folders, one per host, as docs/security.md tells an operator to deal them out.

    folders = host_key_folders(tmp / "keys", cfg)     # {"h0": tmp/keys-h0, "h1": tmp/keys-h1, ...}

The operator's folder (`root`) gets the cluster key pair, the weights signing key and one client
key per identity the config's roles act as (`rollout.<id>`, `relay.<id>`, `reward.<scorer>`, and
the unnamed scopes), plus `node`. Each host's folder then holds only what that host may hold:
the cluster key pair (every host runs servers), the public weights key, every public client key
(each authenticator admits all of them), the secret of each identity its roles act as and `node`
(its `laminar-node start`), and `weights.key_secret` only where the trainer runs. Never
`operator`. A compromised host is then exactly its folder: a hostile script given that folder has
what an attacker on that host would have (laminar/testing/hostile_host.py).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from laminar.bus.auth import CLIENTS, SCOPES, generate_client_key, generate_keys
from laminar.testing.inproc_cluster import role_identity

NODE = "node"  # the client key `laminar-node start` uses where no `operator` key is present


def identities(cfg) -> dict[str, set[str]]:
    """Host id -> the client key identities its roles (and its node) act as."""
    out: dict[str, set[str]] = {h: {NODE} for h in cfg.cluster.hosts}
    for host, spec in cfg.placements():
        out[host].add(role_identity(cfg, spec.role, str(spec.id)))
    return out


def host_key_folders(root: Path, cfg) -> dict[str, Path]:
    """Make the operator's folder `root` and one folder per host beside it (`<root>-<host>`)."""
    root = Path(root)
    generate_keys(root)
    per_host = identities(cfg)
    named = sorted(set().union(*per_host.values()) - set(SCOPES))
    for ident in [*SCOPES, *named]:
        generate_client_key(root, ident)
    return {host: _host_folder(root, Path(f"{root}-{host}"), wanted, any(
        s.role == "trainer" for h, s in cfg.placements() if h == host)) for host, wanted in per_host.items()}


def _host_folder(root: Path, dest: Path, wanted: set[str], trainer: bool) -> Path:
    (dest / CLIENTS).mkdir(parents=True, exist_ok=True, mode=0o700)
    dest.chmod(0o700)
    (dest / CLIENTS).chmod(0o700)
    files = ["cluster.key", "cluster.key_secret", "weights.key"] + (["weights.key_secret"] if trainer else [])
    for name in files:
        shutil.copy2(root / name, dest / name)
    for pub in (root / CLIENTS).glob("*.key"):
        shutil.copy2(pub, dest / CLIENTS / pub.name)
    for ident in wanted:
        shutil.copy2(root / CLIENTS / f"{ident}.key_secret", dest / CLIENTS / f"{ident}.key_secret")
    return dest
