"""`roles.trainer.moe`: the trainer's settings for mixture-of-experts policies (docs/moe.md).

A model of its own file so the config loader reads it without torch; the mechanism is
routing_replay.py.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TrainerMoe(BaseModel):
    """Mixture-of-experts policies: routing replay and the load-balancing loss (docs/moe.md)."""
    model_config = ConfigDict(extra="forbid")
    routing_replay: bool = Field(False, description="the logprob passes (policy, old/proximal, reference, the "
                                 "previous version's) route each token to the experts the rollout's engine chose "
                                 "(the trajectory's recorded routing, roles.rollout.moe.routing) instead of the "
                                 "trainer's own top-k; the gate weights of those experts still come from the "
                                 "trainer's router softmax, so the router keeps learning. Positions without a "
                                 "recorded row use the trainer's own top-k (counted as routing_unreplayed_share)")
    router_aux_loss_coef: float | None = Field(None, ge=0, description="weight of the load-balancing loss "
                                               "(Switch Transformer's: experts x sum of token share x mean router "
                                               "probability, over the training forward's tokens) added to the "
                                               "policy loss; None: the model config's router_aux_loss_coef (0 "
                                               "for a dense model); 0: off")
