"""Role kind -> implementing class, imported lazily by dotted path."""
from __future__ import annotations

import importlib

REGISTRY: dict[str, str] = {
    "broker": "laminar.roles.broker:BrokerRole",
    "echo": "laminar.roles.echo:EchoRole",
}


def role_class(name: str) -> type:
    try:
        module, cls = REGISTRY[name].split(":")
    except KeyError:
        raise KeyError(f"unknown role {name!r}; known roles: {sorted(REGISTRY)}") from None
    return getattr(importlib.import_module(module), cls)


def role_config_class(name: str) -> type:
    return role_class(name).Config
