"""The chunk link's handshake: mutual proof of the cluster key, the link's keys, and (for a trainer's
links) proof of the trainer's signing key. Everything after it goes through a wire.Channel.

    C -> A  HELLO   (a=DATA_PROTOCOL, b=purpose, payload nonce_c)
    A -> C  HELLO   (a=DATA_PROTOCOL, payload nonce_a + hmac(key, "A" + nonce_c))
    C -> A  PROOF   (payload hmac(key, tag(purpose) + nonce_a) [+ Ed25519 signature of the transcript])
    A -> C  WELCOME (the first message of the Channel: MAC'd with the link's key)

`key` is derived from the cluster secret (wire.derive_key), so the secret itself never crosses the
wire. Both ends then derive the link's session key from the key, the purpose and both nonces,
and from it one key per direction: every later message carries a MAC under them (wire.py).

`purpose` is covered by the proof:
- LINK: a relay upstream that will stream versions (it replaces the receiving relay's upstream);
- PUBLISH: the trainer's publisher, to the master relay (the same as LINK on the wire; a relay
  told it is the master keeps it, but drops a LINK upstream, which can only be a stale relay);
- PART: one host of a multi-host trainer (it never displaces the upstream; several at once);
- PROBE: the manager checking that the port really serves; answered and closed.
A LINK to a relay that holds a link key (the relay role's: it gives the key to the manager when
it joins, over its encrypted bus connection) must also prove it is the upstream the manager
named: the manager hands that upstream, in SetDownstream, `link_token(key, epoch, upstream_id)`,
and the PROOF carries (epoch, upstream_id, MAC of the transcript under that token). Any other
peer, though it holds the cluster secret, is refused (`LinkRefused`) and never displaces the
relay's upstream; the relay also refuses a claim older than the link it has (node.py).
PUBLISH and PART come only from trainer hosts: when the accepting relay has the public key of the
trainer's signing key (`verifier`), the PROOF must also carry an Ed25519 signature, by the
matching secret, of the purpose and both nonces; a peer that only holds the cluster secret (any
relay or rollout host) is refused. A peer with another protocol version or a wrong proof gets its
connection closed with a LinkError naming the reason; the handshake runs under a deadline.
"""
from __future__ import annotations

import hashlib
import hmac
import os

import blake3
import msgpack

from laminar.weights import wire
from laminar.weights.seal import SealError, Signer, verify_signature
from laminar.weights.transport import ChunkTransport, Conn, LinkError

PURPOSE_LINK, PURPOSE_PROBE, PURPOSE_PART, PURPOSE_PUBLISH = 0, 1, 2, 3
PURPOSES = {PURPOSE_LINK: "link", PURPOSE_PROBE: "probe", PURPOSE_PART: "part", PURPOSE_PUBLISH: "publish"}
_PROOF_TAG = {PURPOSE_LINK: b"C", PURPOSE_PROBE: b"P", PURPOSE_PART: b"S", PURPOSE_PUBLISH: b"T"}
TRAINER_ONLY = frozenset({PURPOSE_PART, PURPOSE_PUBLISH})
_TRANSCRIPT = b"laminar trainer upstream v3\0"
_LINK_TOKEN = b"laminar named link v1\0"


class LinkRefused(LinkError):
    """A relay link whose peer did not prove it is the upstream the manager named."""


def link_token(link_key: bytes, epoch: int, upstream_id: str) -> bytes:
    """What the manager gives upstream `upstream_id` to link, at chain `epoch`, into the relay
    whose link key is `link_key` (only that relay and the manager know the key)."""
    return hmac.new(link_key, _LINK_TOKEN + f"{int(epoch)}\0{upstream_id}".encode(), hashlib.sha256).digest()


def _link_claim(claim: tuple[int, str, bytes], nonce_c: bytes, nonce_a: bytes) -> bytes:
    epoch, upstream_id, token = claim
    mac = hmac.new(token, _transcript(PURPOSE_LINK, nonce_c, nonce_a), hashlib.sha256).digest()
    return msgpack.packb([int(epoch), str(upstream_id), mac])


def _check_claim(raw: bytes, link_key: bytes, nonce_c: bytes, nonce_a: bytes) -> tuple[int, str]:
    """(epoch, upstream id) of a LINK's claim to be the named upstream, or LinkRefused."""
    try:
        epoch, upstream_id, mac = msgpack.unpackb(raw)
        epoch, upstream_id, mac = int(epoch), str(upstream_id), bytes(mac)
    except Exception:  # noqa: BLE001 - msgpack raises a zoo of types on garbage; none of them is a claim
        raise LinkRefused("link refused: the peer does not claim to be the upstream the manager named") from None
    want = _link_claim((epoch, upstream_id, link_token(link_key, epoch, upstream_id)), nonce_c, nonce_a)
    if not hmac.compare_digest(msgpack.unpackb(want)[2], mac):
        raise LinkRefused(f"link refused: the peer claims to be {upstream_id!r} at chain epoch {epoch} without "
                          "the manager's token for it")
    return epoch, upstream_id


def _mac(key: bytes, who: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, who + nonce, hashlib.sha256).digest()


def _transcript(purpose: int, nonce_c: bytes, nonce_a: bytes) -> bytes:
    return _TRANSCRIPT + bytes([purpose]) + nonce_c + nonce_a


def _channel(conn: Conn, key: bytes, purpose: int, nonce_c: bytes, nonce_a: bytes, client: bool) -> wire.Channel:
    """The link's Channel: one key per direction, derived from the session's key."""
    session = hmac.new(key, b"session" + bytes([purpose]) + nonce_c + nonce_a, hashlib.sha256).digest()
    c2a = blake3.blake3(session, derive_key_context="laminar 2026-11 chunk link v3 client to acceptor").digest()
    a2c = blake3.blake3(session, derive_key_context="laminar 2026-11 chunk link v3 acceptor to client").digest()
    return wire.Channel(conn, c2a, a2c) if client else wire.Channel(conn, a2c, c2a)


def _check_protocol(h: wire.Header) -> None:
    if h.a != wire.DATA_PROTOCOL:
        raise LinkError(f"protocol mismatch: peer speaks chunk protocol {h.a}, this side speaks "
                        f"{wire.DATA_PROTOCOL}")


def _expect(conn: Conn, typ: int) -> tuple[wire.Header, bytes]:
    h = wire.recv_header(conn)
    if h.type != typ:
        raise LinkError(f"expected {wire.NAMES[typ]}, got {wire.NAMES[h.type]}")
    return h, wire.recv_payload(conn, h)


def client_handshake(conn: Conn, key: bytes, timeout: float = 5.0, purpose: int = PURPOSE_LINK,
                     signer: Signer | None = None, claim: tuple[int, str, bytes] | None = None) -> wire.Channel:
    """`claim`: (epoch, this relay's id, the manager's token) for a LINK into a relay that checks it."""
    conn.set_handshake_timeout(timeout)
    nonce_c = os.urandom(32)
    wire.send_plain(conn, wire.HELLO, a=wire.DATA_PROTOCOL, b=purpose, payload=nonce_c)
    h, body = _expect(conn, wire.HELLO)
    _check_protocol(h)
    if len(body) != 64 or not hmac.compare_digest(body[32:], _mac(key, b"A", nonce_c)):
        raise LinkError("peer failed to prove it holds the cluster key")
    nonce_a = body[:32]
    proof = _mac(key, _PROOF_TAG[purpose], nonce_a)
    if signer is not None and purpose in TRAINER_ONLY:
        proof += signer.sign(_transcript(purpose, nonce_c, nonce_a))
    elif claim is not None and purpose == PURPOSE_LINK:
        proof += _link_claim(claim, nonce_c, nonce_a)
    wire.send_plain(conn, wire.PROOF, payload=proof)
    ch = _channel(conn, key, purpose, nonce_c, nonce_a, client=True)
    if ch.recv().type != wire.WELCOME:
        raise LinkError("expected WELCOME")
    conn.set_handshake_timeout(None)
    return ch


def server_handshake(conn: Conn, key: bytes, timeout: float = 5.0, verifier: bytes | None = None,
                     link_key: bytes | None = None) -> tuple[int, wire.Channel]:
    """Authenticate the connecting peer: (its purpose, the link's Channel). With `verifier` (the
    trainer's public signing key) a PART or PUBLISH peer must prove it holds the secret key; with
    `link_key` a LINK peer must prove it is the upstream the manager named (LinkRefused), and the
    Channel's `claim` is then its (epoch, upstream id)."""
    conn.set_handshake_timeout(timeout)
    h, nonce_c = _expect(conn, wire.HELLO)
    _check_protocol(h)
    if len(nonce_c) != 32 or h.b not in _PROOF_TAG:
        raise LinkError("bad HELLO")
    purpose = h.b
    nonce_a = os.urandom(32)
    wire.send_plain(conn, wire.HELLO, a=wire.DATA_PROTOCOL, payload=nonce_a + _mac(key, b"A", nonce_c))
    _, proof = _expect(conn, wire.PROOF)
    if not hmac.compare_digest(proof[:32], _mac(key, _PROOF_TAG[purpose], nonce_a)):
        raise LinkError("connection refused: peer does not hold the cluster key")
    if verifier is not None and purpose in TRAINER_ONLY:
        try:
            verify_signature(verifier, proof[32:], _transcript(purpose, nonce_c, nonce_a))
        except SealError:
            raise LinkError(f"{PURPOSES[purpose]} upstream refused: the peer does not hold the trainer's signing "
                            "key (weights.key_secret): only trainer hosts publish") from None
    claim = _check_claim(proof[32:], link_key, nonce_c, nonce_a) if link_key and purpose == PURPOSE_LINK else None
    ch = _channel(conn, key, purpose, nonce_c, nonce_a, client=False)
    ch.claim = claim
    ch.send(wire.WELCOME)
    conn.set_handshake_timeout(None)
    return purpose, ch


def probe(transport: ChunkTransport, address: str, key: bytes, timeout: float) -> None:
    """Connect, complete a PROBE handshake and close: raises LinkError unless the relay at
    `address` accepts, answers and proves it holds the key within `timeout`."""
    conn = transport.connect(address, timeout)
    try:
        client_handshake(conn, key, timeout, purpose=PURPOSE_PROBE)
    finally:
        conn.close()


def connect(transport: ChunkTransport, address: str, key: bytes, timeout: float,
            purpose: int = PURPOSE_LINK, signer: Signer | None = None,
            claim: tuple[int, str, bytes] | None = None) -> wire.Channel:
    """Connect and authenticate (client side); the connection is closed if the handshake fails."""
    conn = transport.connect(address, timeout)
    try:
        return client_handshake(conn, key, timeout, purpose=purpose, signer=signer, claim=claim)
    except BaseException:
        conn.close()
        raise
