"""Role kind -> implementing class, imported lazily by dotted path."""
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
    try:
        module, cls = REGISTRY[name].split(":")
    except KeyError:
        raise KeyError(f"unknown role {name!r}; known roles: {sorted(REGISTRY)}") from None
    return getattr(importlib.import_module(module), cls)


def role_config_class(name: str) -> type:
    return role_class(name).Config
