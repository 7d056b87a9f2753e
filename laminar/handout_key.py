"""The key the pools sign hand-outs with (roles/handout.py says what a hand-out proves).

It lives in the core because `laminar-node check` reads it too (a scoped cluster whose pools'
host lacks the pool key fails there, before any role starts), and the core imports no role:

- with scoped keys (`<keys_dir>/clients/`): derived from `clients/pool.key_secret`, which only
  the pools' hosts hold;
- with one cluster key: from the cluster secret (every holder is a full member anyway);
- without keys (tests, a single machine): from the run's name, a consistency check, not a secret.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import zmq.auth

from laminar.bus.auth import CLIENTS, _check_secret_file, check_private

POOL_KEY = "pool"          # clients/pool.key_secret: the pools' client key with scoped keys
PERSON = b"laminar-handout"


def handout_key(cluster) -> bytes:
    """The key hand-outs are signed with (module docstring); raises naming the missing file."""
    d = cluster.cluster.keys_dir if cluster is not None else None
    if not d:
        run = cluster.run.name if cluster is not None else ""
        return hashlib.blake2b(f"laminar hand-outs of run {run}".encode(), digest_size=32).digest()
    clients = Path(d) / CLIENTS
    if clients.is_dir():
        path = clients / f"{POOL_KEY}.key_secret"
        if not path.exists():
            raise FileNotFoundError(f"{d} uses scoped keys but holds no {CLIENTS}/{POOL_KEY}.key_secret, which the "
                                    f"pools sign hand-outs with: run `laminar-node keygen {d} --client {POOL_KEY}` "
                                    "where the keys are made and copy it to the pools' hosts (only there)")
        _check_secret_file(path)
    else:
        path = check_private(d)
    _, secret = zmq.auth.load_certificate(str(path))
    if not secret:
        raise ValueError(f"{path} holds no secret key")
    return hashlib.blake2b(secret, digest_size=32, person=PERSON).digest()
