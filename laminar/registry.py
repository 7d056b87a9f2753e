"""The role registry: role kind -> the class that implements it, and its settings model.

This is the one place roles are named. The core (the config, the shell, `laminar-node check`)
needs every role's class and settings model, but must not import `laminar.roles` (the roles import
the core, and arrows run one way: docs/architecture.md §1): so each role is named here by its
import path, a string, and resolved with importlib when a process asks for it. Adding a role is a
line here and a row in docs/architecture.md §2.
"""
from __future__ import annotations

import importlib

REGISTRY: dict[str, str] = {
    "broker": "laminar.roles.broker:BrokerRole",
    "echo": "laminar.roles.echo:EchoRole",
    "manager": "laminar.roles.manager.role:ManagerRole",
    "relay": "laminar.roles.relay.role:RelayRole",
    "rollout": "laminar.roles.rollout.role:RolloutRole",
    "prompt_pool": "laminar.roles.prompt_pool.role:PromptPoolRole",
    "partial_pool": "laminar.roles.partial_pool.role:PartialPoolRole",
    "experience_buffer": "laminar.roles.experience_buffer.role:ExperienceBufferRole",
    "trainer": "laminar.roles.trainer.role:TrainerRole",
    "env": "laminar.roles.env.role:EnvRole",
    "evaluator": "laminar.roles.evaluator.role:EvaluatorRole",
    "reward": "laminar.roles.reward.role:RewardRole",
    "gateway": "laminar.roles.gateway.role:GatewayRole",
    "agent": "laminar.roles.agent.role:AgentRole",
}


def role_class(name: str) -> type:
    """The class of role `name`, imported now (KeyError naming the known roles)."""
    try:
        module, cls = REGISTRY[name].split(":")
    except KeyError:
        raise KeyError(f"unknown role {name!r}; known roles: {sorted(REGISTRY)}") from None
    return getattr(importlib.import_module(module), cls)


def role_config_class(name: str) -> type:
    """The settings model of role `name` (its class's `Config`)."""
    return role_class(name).Config
