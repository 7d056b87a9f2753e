"""Settings of the prompt pool (`roles.prompt_pool`): the dataset and its fields, the GRPO group
size, the flow-control gate and the curriculum."""
from __future__ import annotations

from laminar.roles.prompt_pool.curriculum import CurriculumConfig
from laminar.roles.sqlite_store import commit_window_field
from pydantic import BaseModel, ConfigDict, Field

from laminar.datasets import chat_template_field, system_prompt_field


class PromptPoolConfig(BaseModel):
    """Settings of the prompt pool: the dataset and its fields, GRPO group size, the gate."""
    model_config = ConfigDict(extra="forbid")
    dataset: str = Field(description="JSONL/Parquet file or folder (relative to the working directory)")
    prompt_field: str = Field("prompt", description="record field with the prompt text")
    answer_field: str = Field("answer", description="record field with the reference answer")
    id_field: str | None = Field(None, description="record field with a stable prompt id (default: row number)")
    on_bad_row: str = Field("error", pattern="^(error|skip)$", description="malformed row: fail or skip")
    tokenizer_dir: str | None = Field(None, description="model folder whose tokenizer to use (default: byte tokenizer)")
    chat_template: str = chat_template_field()
    system_prompt: str | None = system_prompt_field()
    group_size: int = Field(4, ge=1, description="GRPO group size n (responses per prompt)")
    max_tokens: int = Field(256, ge=1, description="response token budget of each trajectory")
    max_epochs: int | None = Field(None, ge=1, description="stop handing out after this many epochs (None: forever)")
    seed: int = Field(0, description="shuffle seed")
    store_dir: str | None = Field(None, description="folder of the SQLite store (default: <workdir>/pools)")
    commit_window_s: float = commit_window_field()
    groups_per_version: int | None = Field(
        None,
        ge=1,
        description="groups of one global batch, for the barrier "
        "modes' gate and max_batches_ahead (default: the trainer's groups_per_batch)",
    )
    max_batches_ahead: int | None = Field(
        None,
        ge=0,
        description="laminar modes, flow control: a rollout holding "
        "version v gets groups only while fewer than v + 1 + this many global batches "
        "were handed out, so generation cannot run further ahead of training than "
        "that (when rollouts outpace the trainer, what they make beyond it would only "
        "grow stale in the buffer). None: no bound (the paper's setting). Unlike a "
        "barrier mode's gate this never holds weights back: a rollout still loads the "
        "newest version whenever its own batch ends",
    )
    max_batch_trajectories: int = Field(65_536, ge=1, description="most trajectories one TakeBatch gets, "
                                        "whatever it asks for (a bound on the work and memory of one request)")
    curriculum: CurriculumConfig | None = Field(None, description="difficulty curriculum: retire prompts always "
                                                "solved, visit never-solved ones less often (None: off)")
