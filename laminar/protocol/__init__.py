"""The one protocol of Laminar: every event and request that crosses a process boundary.

Each message kind is a frozen dataclass registered with `@event("kind")`; the registry is what the
codec (bus/codec.py) uses to route a frame before decoding its body. Arrays are numpy arrays in
fields and travel as raw extra frames (dtype + shape in the header), never as lists.

Rules (docs/architecture.md §4): add fields at the end only, with defaults; any incompatible change bumps
PROTOCOL_VERSION, which every frame carries and every handshake compares.

Submodules group the kinds by area (core: handshakes, errors, heartbeats, logs, metrics; later
areas add their own files here) but this package is the only place kinds are defined.
"""
from laminar.protocol import agent as _agent
from laminar.protocol import core as _core
from laminar.protocol import data as _data
from laminar.protocol import env as _env
from laminar.protocol import reward as _reward
from laminar.protocol import rollout as _rollout
from laminar.protocol import weights as _weights
from laminar.protocol.agent import *  # noqa: F401,F403
from laminar.protocol.core import *  # noqa: F401,F403  (re-export every kind)
from laminar.protocol.data import *  # noqa: F401,F403
from laminar.protocol.env import *  # noqa: F401,F403
from laminar.protocol.registry import PROTOCOL_VERSION, event, kind_of, lookup, registered_kinds
from laminar.protocol.reward import *  # noqa: F401,F403
from laminar.protocol.rollout import *  # noqa: F401,F403
from laminar.protocol.weights import *  # noqa: F401,F403

__all__ = [
    "PROTOCOL_VERSION",
    "event",
    "kind_of",
    "lookup",
    "registered_kinds",
    *_core.__all__,
    *_data.__all__,
    *_rollout.__all__,
    *_weights.__all__,
    *_env.__all__,
    *_reward.__all__,
    *_agent.__all__,
]
