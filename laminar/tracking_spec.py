"""The `tracking:` section of the run config: which experiment trackers a run is sent to (W&B,
MLflow) and how. The sending is laminar/tracking.py's (and laminar/live_tracking.py's, live);
the models live apart so that the config (laminar/config.py) holds them without importing the
module that reads configs to send runs (no import circle).
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class WandbSpec(BaseModel):
    """Where a run goes in Weights & Biases."""
    model_config = ConfigDict(extra="forbid")
    project: str = Field("laminar", description="W&B project")
    entity: str | None = Field(None, description="W&B entity (team or user); None: the account's default")
    name: str | None = Field(None, description="run name (default: run.name)")
    mode: str = Field("offline", pattern="^(offline|online)$", description="offline: written under dir only (send "
                      "later with `wandb sync`); online: needs WANDB_API_KEY and network")
    dir: str | None = Field(None, description="folder of the wandb/ run folders (default: the run's workdir)")


class MlflowSpec(BaseModel):
    """Where a run goes in MLflow."""
    model_config = ConfigDict(extra="forbid")
    tracking_uri: str | None = Field(None, description="a tracking server, or a file store `file:<folder>` "
                                     "(default: file:<workdir>/mlruns)")
    experiment: str | None = Field(None, description="experiment name (default: run.name)")
    run_name: str | None = Field(None, description="run name (default: run.name)")


class TrackingSpec(BaseModel):
    """Experiment trackers the run is sent to: live as it trains (laminar/live_tracking.py) and at its end."""
    model_config = ConfigDict(extra="forbid")
    wandb: WandbSpec | None = Field(None, description="Weights & Biases; None: not sent")
    mlflow: MlflowSpec | None = Field(None, description="MLflow; None: not sent")
    live: bool = Field(True, description="send each version's metrics, evaluations and sample rows as they happen "
                       "(from the trainer's node; `--resume` continues the same tracker runs); false: the whole run "
                       "once, at its end")
    queue_size: int = Field(1000, ge=1, description="live updates waiting per tracker; beyond, updates for a slow "
                            "or dead tracker are dropped and counted (training never waits for a tracker)")
    close_timeout_s: float = Field(30.0, gt=0, description="at the end of the run, how long to wait for each "
                                   "tracker to take what is queued before leaving it behind")
