"""Typed errors of the bus. Callers catch these, never raw zmq or msgpack exceptions.

Hierarchy:
  BusError
    CodecError           a frame could not be decoded (the receiver counts and drops it)
      MalformedFrame, OversizedFrame, UnknownKind, ProtocolMismatch
    RpcError             a call did not produce a reply
      PeerUnavailable    no reply in time, or the peer disconnected / is shutting down
        DeadlineExceeded the per-call deadline passed
      RemoteError        the server answered with a typed ErrorReply (see .code)
        Refused, Busy    the codes callers most often branch on
"""
from __future__ import annotations


class BusError(Exception):
    pass


class CodecError(BusError):
    meta: dict | None = None  # the envelope, when it could be read (lets a server name the request)


class MalformedFrame(CodecError):
    pass


class OversizedFrame(CodecError):
    pass


class UnknownKind(CodecError):
    pass


class ProtocolMismatch(CodecError):
    def __init__(self, theirs: object, ours: int):
        super().__init__(f"protocol mismatch: peer speaks protocol {theirs}, this side speaks protocol {ours}")
        self.theirs, self.ours = theirs, ours


class RpcError(BusError):
    pass


class PeerUnavailable(RpcError):
    pass


class DeadlineExceeded(PeerUnavailable):
    pass


class RemoteError(RpcError):
    def __init__(self, code: str, message: str):
        super().__init__(f"[{code}] {message}")
        self.code, self.message = code, message


class Refused(RemoteError):
    pass


class Busy(RemoteError):
    pass


def remote_error(code: str, message: str) -> RemoteError:
    """The exception a client raises for an ErrorReply with this code."""
    if code == "refused":
        return Refused(code, message)
    if code == "busy":
        return Busy(code, message)
    if code == "protocol_mismatch":
        return RemoteError(code, message)
    if code in ("deadline", "unavailable"):
        return RemoteError(code, message)
    return RemoteError(code, message)
