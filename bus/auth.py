"""CURVE authentication (ZeroMQ's built-in elliptic-curve security) and key scopes.

`laminar-node keygen DIR` writes `cluster.key` (public) and `cluster.key_secret` (public + secret).
Every server socket (broker XSUB/XPUB, RPC ROUTERs) is a CURVE server with the cluster key and a
ZAP authenticator. With auth disabled (keys_dir None) everything is plaintext.

Two modes, chosen by whether DIR has a `clients/` folder:
- one key (no `clients/`): the authenticator admits only clients presenting the cluster *public*
  key as their own, which only a holder of the cluster secret can do; every holder may do
  everything (identity "cluster").
- scoped keys (`laminar-node keygen DIR --scopes`, `--client SCOPE[.NAME]`): every client
  presents a key of its own scope, `clients/<scope>[.<name>].key_secret`; the authenticator
  admits exactly the public keys in `clients/*.key` (the cluster key no longer opens anything as
  a client: it only makes a process a server) and names each connection by its key's file name,
  "scope" or "scope.name". ZeroMQ attaches that name to every message as `User-Id`; the broker
  (`topic_refusal`) and every request/reply server (`request_refusal`) check it against what the
  scope may do. A role process uses the key of its role's scope (ROLE_SCOPE), the key named after
  its id first (`rollout.r0`); other processes (the CLI, `laminar-node up/start`) use `operator`
  where it exists, else `node`.

The weights signing key (`weights.key` public, `weights.key_secret` secret; Ed25519, made with the
cluster key or by `laminar-node keygen DIR --weights`): the trainer seals every weight version
with the secret and relays and rollouts check the seals with the public key
(laminar/weights/seal.py), so only a holder of the secret can make weights that rollouts load.
Copy `weights.key` to every host and `weights.key_secret` to the trainer's hosts only; only a
process of the trainer scope loads the secret (`CurveKeys.weights_secret`).

On disk: the key folder is 0700 and both files 0600, owned by the user the roles run as. Files are
created with their final mode (os.open with a mode, whatever the umask) under a temporary name and
then linked into place, so no reader ever sees a partial or briefly world-readable key. Loading
refuses a secret that group or others can read or write, a secret owned by another user, and a
folder others can write (where the file could be swapped), each with a message saying the fix.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

KEY_NAME = "cluster"
WEIGHTS_KEY = "weights"  # weights.key / weights.key_secret: the trainer's Ed25519 signing key
CLIENTS = "clients"
# who may do what: see docs/security.md (the table there is this code in words)
SCOPES = ("operator", "node", "trainer", "manager", "relay", "rollout", "env", "pool", "broker", "evaluator",
          "reward", "gateway", "agent")
ROLE_SCOPE = {"trainer": "trainer", "manager": "manager", "relay": "relay", "rollout": "rollout", "env": "env",
              "prompt_pool": "pool", "partial_pool": "pool", "experience_buffer": "pool", "broker": "broker",
              "evaluator": "evaluator", "reward": "reward", "gateway": "gateway", "agent": "agent"}
ALL = "cluster"  # the identity of the single cluster key (one-key mode): may do everything


@dataclass(frozen=True)
class CurveKeys:
    public: bytes      # the cluster (server) key pair
    secret: bytes
    public_dir: str    # folder holding the admitted public key(s), for the ZAP handler
    client_public: bytes | None = None   # this process's client key (scoped mode); None: the cluster key
    client_secret: bytes | None = None
    identity: str = ALL                  # what servers will call this process ("rollout.r0", "operator"...)
    scoped: bool = False
    weights_public: bytes | None = None  # the trainer's public signing key (raw 32 bytes): checks seals
    weights_secret: bytes | None = None  # its secret (raw 32 bytes): loaded by trainer processes only


class KeyFileError(PermissionError):
    """The key folder or file is not private to this user: refused rather than used."""


def _write_private(path: Path, text: str, overwrite: bool) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)  # in case the umask took bits the mode asked for
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # atomic and never replaces: FileExistsError if a key appeared meanwhile
    finally:
        if tmp.exists():
            tmp.unlink()


def _cert(public: bytes, secret: bytes | None) -> str:
    lines = ["#   ZeroMQ CURVE certificate of a Laminar cluster (made by laminar-node keygen)",
             "#   " + ("SECRET: keep it 0600 on the hosts of the cluster only" if secret else "public key"),
             "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def generate_keys(directory: str | os.PathLike, overwrite: bool = False) -> tuple[Path, Path]:
    """Write a new cluster key pair into `directory` (made 0700); both files 0600."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = d.stat()
    if st.st_uid != os.geteuid():
        raise KeyFileError(f"{d} is owned by uid {st.st_uid}, not by this user ({os.geteuid()}): "
                           "make the key folder in a place of your own")
    os.chmod(d, 0o700)
    pub, sec = d / f"{KEY_NAME}.key", d / f"{KEY_NAME}.key_secret"
    if not overwrite and (pub.exists() or sec.exists()):
        raise FileExistsError(f"{pub} already exists; pass --force to replace the cluster key")
    public, secret = zmq.curve_keypair()
    _write_private(sec, _cert(public, secret), overwrite)  # the secret first: a pub alone is useless
    _write_private(pub, _cert(public, None), overwrite)
    if overwrite or not (d / f"{WEIGHTS_KEY}.key").exists():
        generate_weights_key(d, overwrite=True)
    return pub, sec


def _weights_cert(public: bytes, secret: bytes | None) -> str:
    lines = ["#   Ed25519 key the trainer signs weight versions with (made by laminar-node keygen)",
             "#   " + ("SECRET: keep it 0600 on the trainer's hosts only" if secret else
                     "public key: copy it to every host"),
             f'public-key = "{public.hex()}"']
    if secret:
        lines.append(f'secret-key = "{secret.hex()}"')
    return "\n".join(lines) + "\n"


def generate_weights_key(directory: str | os.PathLike, overwrite: bool = False) -> tuple[Path, Path]:
    """Write a new weights signing key pair (`weights.key`, `weights.key_secret`, both 0600)."""
    # late: cryptography, only when a weights key is made
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    d = Path(directory)
    pub, sec = d / f"{WEIGHTS_KEY}.key", d / f"{WEIGHTS_KEY}.key_secret"
    if not overwrite and (pub.exists() or sec.exists()):
        raise FileExistsError(f"{pub} already exists; pass --force to replace the weights signing key")
    key = Ed25519PrivateKey.generate()
    secret, public = key.private_bytes_raw(), key.public_key().public_bytes_raw()
    _write_private(sec, _weights_cert(public, secret), overwrite)
    _write_private(pub, _weights_cert(public, None), overwrite)
    return pub, sec


def _read_weights_key(path: Path, field: str) -> bytes:
    for line in path.read_text().splitlines():
        name, _, value = line.partition("=")
        if name.strip() == field:
            raw = bytes.fromhex(value.strip().strip('"'))
            if len(raw) == 32:
                return raw
    raise ValueError(f"{path}: no {field} (32 bytes, hex) in it: make it again with `laminar-node keygen --weights`")


def load_weights_key(directory: str | os.PathLike, secret: bool) -> tuple[bytes | None, bytes | None]:
    """(public, secret) of the weights signing key in a key folder: the public key if
    `weights.key` exists, the secret only when asked (a trainer) and `weights.key_secret` exists
    (checked private like every secret)."""
    d = Path(directory)
    pub_path, sec_path = d / f"{WEIGHTS_KEY}.key", d / f"{WEIGHTS_KEY}.key_secret"
    public = _read_weights_key(pub_path, "public-key") if pub_path.exists() else None
    if not (secret and sec_path.exists()):
        return public, None
    _check_secret_file(sec_path)
    return public, _read_weights_key(sec_path, "secret-key")


def check_private(directory: str | os.PathLike) -> Path:
    """The secret key file of `directory`, after checking folder and file are private to us."""
    d = Path(directory)
    sec = d / f"{KEY_NAME}.key_secret"
    if not sec.exists():
        raise FileNotFoundError(
            f"cluster key {sec} not found: run `laminar-node keygen {directory}` on one host and copy "
            "the folder to every host")
    me = os.geteuid()
    dst = d.stat()
    if dst.st_uid not in (me, 0) or stat.S_IMODE(dst.st_mode) & 0o022:
        raise KeyFileError(f"key folder {d} is writable by others or owned by uid {dst.st_uid}: "
                           f"`chown {me} {d} && chmod 700 {d}`")
    st = os.stat(sec, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"{sec} is not a regular file")
    if st.st_uid != me:
        raise KeyFileError(f"{sec} is owned by uid {st.st_uid}, not by the user running this role ({me}): "
                           f"`chown {me} {sec}`")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise KeyFileError(f"{sec} has mode {stat.S_IMODE(st.st_mode):o}: group or others can read it, so "
                           f"the cluster key may be known outside this user; `chmod 600 {sec}` (and think "
                           "about replacing the key)")
    return sec


def _check_secret_file(path: Path) -> None:
    me = os.geteuid()
    st = os.stat(path, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != me or stat.S_IMODE(st.st_mode) & 0o077:
        raise KeyFileError(f"{path}: must be a regular file of uid {me} with mode 0600 (`chmod 600 {path}`)")


def generate_client_key(directory: str | os.PathLike, identity: str, overwrite: bool = False) -> Path:
    """Write a client key `clients/<identity>.key_secret` (and its public `.key`) into a key folder;
    `identity` is a scope, or scope.name (e.g. rollout.r0: a key that only rollout r0 holds)."""
    scope, _, name = identity.partition(".")
    ok = scope and all(c.islower() or c == "_" for c in scope) and all(c.isalnum() or c in "-_" for c in name)
    if not ok or (name == "" and identity.endswith(".")):
        raise ValueError(f"bad client identity {identity!r}: SCOPE or SCOPE.NAME, SCOPE usually one of "
                         f"{', '.join(SCOPES)} (a role outside ROLE_SCOPE uses its role name as scope)")
    d = Path(directory) / CLIENTS
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d, 0o700)
    pub, sec = d / f"{identity}.key", d / f"{identity}.key_secret"
    if not overwrite and (pub.exists() or sec.exists()):
        raise FileExistsError(f"{sec} already exists; pass --force to replace it")
    public, secret = zmq.curve_keypair()
    _write_private(sec, _cert(public, secret), overwrite)
    _write_private(pub, _cert(public, None), overwrite)
    return sec


def client_identities(directory: str | os.PathLike) -> dict[bytes, str]:
    """Admitted client public key (raw 32 bytes) -> identity, from `clients/*.key`."""
    out = {}
    for p in sorted((Path(directory) / CLIENTS).glob("*.key")):
        public, _ = zmq.auth.load_certificate(str(p))
        out[z85.decode(public)] = p.name[:-len(".key")]
    return out


def _client_key(directory: Path, scope: str | None, name: str | None) -> tuple[Path, str]:
    d = directory / CLIENTS
    tries = ([f"{scope}.{name}"] if name else []) + [scope] if scope else ["operator", "node"]
    for ident in tries:
        if ident and (d / f"{ident}.key_secret").exists():
            return d / f"{ident}.key_secret", ident
    want = " or ".join(f"{CLIENTS}/{t}.key_secret" for t in tries if t)
    raise FileNotFoundError(f"{directory} uses scoped keys but holds no {want}: run `laminar-node keygen "
                            f"{directory} --client {tries[-1]}` where the keys are made and copy that file here")


def load_keys(directory: str | os.PathLike, scope: str | None = None, name: str | None = None) -> CurveKeys:
    """The cluster key pair and, in scoped mode, this process's client key: the key of `scope`
    named `name` (a role id) if it exists, else the scope's; without a scope `operator`, else `node`."""
    sec = check_private(directory)
    public, secret = zmq.auth.load_certificate(str(sec))
    if secret is None:
        raise ValueError(f"{sec} holds no secret key")
    d = Path(directory).resolve()
    wpub, wsec = load_weights_key(d, secret=scope == "trainer")
    if not (d / CLIENTS).is_dir():
        return CurveKeys(public=public, secret=secret, public_dir=str(d), weights_public=wpub, weights_secret=wsec)
    path, ident = _client_key(d, scope, name)
    _check_secret_file(path)
    cpub, csec = zmq.auth.load_certificate(str(path))
    if csec is None:
        raise ValueError(f"{path} holds no secret key")
    return CurveKeys(public=public, secret=secret, public_dir=str(d / CLIENTS), client_public=cpub,
                     client_secret=csec, identity=ident, scoped=True, weights_public=wpub, weights_secret=wsec)


def make_server(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    if keys is None:
        return
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def make_client(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    if keys is None:
        return
    sock.curve_secretkey = keys.client_secret or keys.secret
    sock.curve_publickey = keys.client_public or keys.public
    sock.curve_serverkey = keys.public


def start_authenticator(ctx: zmq.Context, keys: CurveKeys | None, threaded: bool = False):
    """Start the ZAP handler for `ctx` (one per context); returns it (call .stop()) or None.
    In scoped mode it names each connection by its key's identity (the messages' User-Id)."""
    if keys is None:
        return None
    if threaded:
        from zmq.auth.thread import ThreadAuthenticator as Auth  # late: the one of the two the caller runs
    else:
        from zmq.auth.asyncio import AsyncioAuthenticator as Auth  # late: the one of the two the caller runs
    auth = Auth(ctx)
    if keys.scoped:
        ids = client_identities(Path(keys.public_dir).parent)
        auth.curve_user_id = lambda client_key: ids.get(bytes(client_key), "unknown")
    else:
        auth.curve_user_id = lambda client_key: ALL
    auth.start()
    auth.configure_curve(domain="*", location=keys.public_dir)
    return auth


# -- what each identity may do ---------------------------------------------------------------------
def scope_of(identity: str | None) -> str:
    """"rollout.r0" -> "rollout"; no identity (auth off, in-process) counts as the one cluster key."""
    return (identity or ALL).partition(".")[0]


def _everything(identity: str | None) -> bool:
    return scope_of(identity) in (ALL, "operator")


# topics other roles act on, and who may publish them (besides operator and the one cluster key)
TOPIC_SCOPES = {b"weights.chain": {"manager"},           # relays and the trainer follow the chain it names
                b"weights.version": {"relay", "trainer"},  # the manager places work by what rollouts hold
                b"relay.progress.": {"relay"},
                b"data.gate_open": {"pool"}}  # wakes the rollouts idle at a prompt pool's gate


def topic_refusal(identity: str | None, topic: bytes) -> str:
    """Why the broker drops a message published on `topic` by `identity` ("" = forwarded).
    Control commands (`ctrl.*`: Shutdown) come from the operator only; a heartbeat (`hb.ROLE.ID`),
    metrics (`metrics.ROLE`) and rollout statistics (`rollout.stats.ID`) only from the scope of
    that role (and from the key named ID when the key has a name, except a reward key, named after
    its scorer: any reward replica's); the chain, version
    announcements and relay progress (TOPIC_SCOPES) only from the scopes that produce them, a version
    announcement (`weights.version.ID`) from a key named ID only its own."""
    if _everything(identity):
        return ""
    if topic.startswith(b"ctrl."):
        return "control commands need the operator key"
    scope, _, name = identity.partition(".")
    for prefix, scopes in TOPIC_SCOPES.items():
        if topic.startswith(prefix) and scope not in scopes:
            return f"a {identity} key may not publish {prefix.decode()}"
    text = topic.decode("utf-8", "replace")
    if text.startswith("weights.version") and scope == "relay" and name and text != f"weights.version.{name}":
        return f"a {identity} key may publish only weights.version.{name} (its own relay's announcements)"
    if text.startswith(("hb.", "metrics.", "rollout.stats.")):
        if text.startswith("rollout.stats."):
            role, rid = "rollout", text[len("rollout.stats."):]
        else:
            parts = text.split(".", 2)
            role, rid = (parts + ["", ""])[1:3]
        # a reward key is named after its scorer, which its replicas share, not after a replica id
        by_name = name and rid and scope != "reward"
        if ROLE_SCOPE.get(role, role) != scope or (by_name and rid != name):
            return f"a {identity} key may not publish {text[:60]} (another role's)"
    return ""


def body_refusal(topic: str, ev) -> str:
    """Why a subscriber drops event `ev` received on `topic` ("" = taken): the identity its body
    names must be the one its topic names. The broker binds the topic to the publisher's key
    (`topic_refusal`); this binds the body to the topic, so a key cannot publish, on its own topic,
    a heartbeat or statistics naming another role (the manager would declare that one dead, or send
    its work to an address the forger chose). Checked for heartbeats (`hb.ROLE.ID`: role and id),
    rollout statistics (`rollout.stats.ID`), relay progress (`relay.progress.ID`), version
    announcements (`weights.version.ID`: relay id) and metrics (`metrics.ROLE`: role)."""
    kind = getattr(type(ev), "kind", "")
    if kind == "heartbeat":
        if topic != f"hb.{ev.role}.{ev.id}":
            return f"heartbeat of {ev.role}.{ev.id} on {topic[:60]}"
    elif kind == "rollout.stats":
        if topic != f"rollout.stats.{ev.rollout_id}":
            return f"statistics of rollout {ev.rollout_id} on {topic[:60]}"
    elif kind == "relay.progress":
        if topic != f"relay.progress.{ev.relay_id}":
            return f"progress of relay {ev.relay_id} on {topic[:60]}"
    elif kind == "weights.version":
        if topic != f"weights.version.{ev.relay_id}":
            return f"version announcement of relay {ev.relay_id} on {topic[:60]}"
    elif topic.startswith("metrics.") and isinstance(getattr(ev, "role", None), str):
        if topic != f"metrics.{ev.role}":
            return f"metrics of {ev.role} on {topic[:60]}"
    return ""


# Every request kind: the roles that serve it, and the key scopes that may send it. DENIED BY
# DEFAULT: a kind not listed here is refused to every scope (operator and the one cluster key may
# send anything). "*" = any admitted key. docs/security.md holds this table in words (a test keeps
# the two the same).
ANY = "*"
REQUESTS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "hello": (("any server",), frozenset({ANY})),                      # protocol handshake, no effect
    "ping": (("echo",), frozenset({ANY})),                             # the test/bench echo role
    # prompt pool
    "data.take_batch": (("prompt_pool",), frozenset({"rollout"})),     # named key: only for itself
    "data.requeue_groups": (("prompt_pool",), frozenset({"manager", "pool"})),  # manager's settling; buffer's
    "data.handed_groups": (("prompt_pool",), frozenset({"manager"})),  # off-lineage drops come from the pool scope
    "data.group_results": (("prompt_pool",), frozenset({"pool"})),    # the buffer's results, for the curriculum
    # partial pool
    "data.append_deltas": (("partial_pool",), frozenset({"rollout", "manager"})),  # manager: restarted orphans
    "data.append_delta_batch": (("partial_pool",), frozenset({"rollout"})),
    "data.in_flight_of": (("partial_pool",), frozenset({"manager"})),  # reading every partial: the manager only
    "data.get_partial": (("partial_pool",), frozenset({"rollout", "manager"})),  # named key: its own only
    "data.reassign_partial": (("partial_pool",), frozenset({"rollout", "manager"})),
    "data.complete_partial": (("partial_pool",), frozenset({"rollout", "manager"})),  # named key: its own
    "data.grant_partials": (("partial_pool",), frozenset({"manager"})),  # who may take over what (MigrateIn)
    "data.group_presence": (("partial_pool", "experience_buffer"), frozenset({"manager"})),
    # experience buffer
    "data.put_trajectory": (("experience_buffer",), frozenset({"rollout", "pool"})),  # named key: its own;
    #                                                         pool: the partial pool hands on model-scored ones
    "data.sample_groups": (("experience_buffer",), frozenset({"trainer"})),
    "data.buffer_stats_request": (("experience_buffer",), frozenset({"trainer"})),
    # rollouts: only the manager moves work
    "rollout.migrate_out": (("rollout",), frozenset({"manager"})),
    "rollout.migrate_in": (("rollout",), frozenset({"manager"})),
    # the relay chain
    "relay.join": (("manager",), frozenset({"relay"})),                # joining the chain (the first: master)
    "relay.set_downstream": (("relay",), frozenset({"manager"})),
    "relay.link_down": (("manager",), frozenset({"relay", "trainer"})),
    "relay.master_query": (("manager",), frozenset({"trainer"})),
    # environments
    "env.reset": (("env",), frozenset({"rollout"})), "env.step": (("env",), frozenset({"rollout"})),
    "env.close": (("env",), frozenset({"rollout"})),
    # model-scored rewards (docs/rewards.md)
    "reward.await": (("partial_pool",), frozenset({"rollout"})),       # named key: its own trajectories
    "reward.lease": (("partial_pool",), frozenset({"reward"})),    # named key: its own scorer's work only
    "reward.submit": (("partial_pool",), frozenset({"reward"})),   # named key: its scorer, its own leases
    # agent episodes (docs/architecture.md §14): rollouts announce theirs, the gateway routes calls
    "agent.announce": (("gateway",), frozenset({"rollout"})),         # named key: as itself
    "agent.call": (("rollout",), frozenset({"gateway"})),
    "agent.end": (("rollout",), frozenset({"gateway"})),
}
REQUEST_SCOPES = {kind: scopes for kind, (_, scopes) in REQUESTS.items()}


def _owner(req) -> str | None:
    """The rollout a request acts as (None for requests that name none)."""
    traj = getattr(req, "trajectory", None)
    if traj is not None:
        return getattr(traj, "rollout_id", None)
    return getattr(req, "rollout_id", None)


def request_refusal(identity: str | None, req) -> str:
    """Why a server refuses request `req` from `identity` ("" = allowed). Denied by default: the
    kind must be in REQUESTS and the key's scope among those that may send it; a rollout key named
    after a rollout ("rollout.r0") acts only as that rollout (the rollout a request names: TakeBatch,
    deltas, puts, reassignments); a reward key named after a scorer ("reward.judge") leases and
    scores only that scorer's work. What a request names by trajectory (reading or completing a
    partial) is checked by the partial pool against the trajectory's owner (`owned_by_other`)."""
    if _everything(identity):
        return ""
    kind = getattr(type(req), "kind", "?")
    allowed = REQUEST_SCOPES.get(kind)
    scope, _, name = identity.partition(".")
    if allowed is None:
        return f"{kind} is not a request any key may send"
    if ANY not in allowed and scope not in allowed:
        return f"a {identity} key may not send {kind}"
    if scope == "rollout" and name:
        owner = _owner(req)
        if owner is not None and str(owner) != name and not (kind == "data.reassign_partial" and owner == ""):
            return f"rollout key {identity} may not act as rollout {owner}"
    if scope == "reward" and name and str(getattr(req, "scorer", name)) != name:
        return f"reward key {identity} may not lease or score the work of scorer {req.scorer}"
    return ""


def owned_by_other(identity: str | None, owner: str | None) -> bool:
    """Whether a trajectory held by rollout `owner` is out of reach of `identity` (a named rollout
    key, "rollout.<id>", reaches only its own; every other key reaches every trajectory)."""
    scope, _, name = (identity or ALL).partition(".")
    return scope == "rollout" and bool(name) and owner is not None and str(owner) != name
