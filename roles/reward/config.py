"""Settings of a reward replica (`roles.reward` in the run config, per-instance `options` on top).

One replica runs one scorer (`scorer`, the name the rollouts' `rewards` terms use: `{role: NAME}`)
with one backend; replicas of the same scorer share its work through the partial pool's leases.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from laminar.engine_settings import EngineSettings
from laminar.secrets import SecretRef, no_literal_secret


class TextSettings(BaseModel):
    """How token ids become text for a judge or an HTTP service."""
    model_config = ConfigDict(extra="forbid")
    tokenizer_dir: str | None = Field(None, description="the policy's model folder whose tokenizer decodes "
                                      "prompts and responses (None: the tiny models' byte tokenizer)")


class ClassifierSettings(BaseModel):
    """A Hugging Face sequence-classification model (a score head) run with transformers."""
    model_config = ConfigDict(extra="forbid")
    model_dir: str = Field(..., description="folder of an AutoModelForSequenceClassification model")
    label: int = Field(0, ge=0, description="the logit that is the score (num_labels 1: the only one)")
    sigmoid: bool = Field(False, description="score = sigmoid(logit) instead of the raw logit")
    max_batch_tokens: int = Field(8192, ge=16, description="padded tokens per forward pass (batched by tokens: "
                                  "sorted by length, cut when count x longest would pass this)")
    max_length: int = Field(2048, ge=8, description="longest prompt + response scored (the rest is cut, left)")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (None: torch's default)")
    device: str = Field("cpu", description="torch device (cpu, cuda, cuda:1)")


class JudgeSettings(EngineSettings):
    """A generative model on a vLLM engine (EngineSettings, as a rollout's) that reads a prompt made
    from a template and answers. Its model folder is required and its max_model_len defaults longer
    (the prompt holds a question, a reference and a response)."""
    model_config = ConfigDict(extra="forbid")
    model_dir: str = Field(..., description="folder of the judge's Hugging Face model")
    template: str = Field("Question: {question}\nReference answer: {reference}\nStudent answer: {response}\n"
                          "Is the student's final answer correct? Reply with one word, yes or no.\nAnswer:",
                          description="prompt; {question}, {reference} and {response} are filled in")
    chat: bool = Field(True, description="wrap the prompt in the judge's chat template (if its tokenizer has one)")
    parser: Literal["verdict", "number", "boxed"] = Field("verdict", description="verdict: the first word found "
                                                           "in `verdicts`; number: the first number; boxed: the "
                                                           "number in the last \\boxed{}")
    verdicts: dict[str, float] = Field(default_factory=lambda: {"yes": 1.0, "no": 0.0, "correct": 1.0,
                                                                "incorrect": 0.0},
                                       description="verdict words (lower case) and their scores")
    fallback: float = Field(0.0, description="score of an answer the parser cannot read (counted as a parse failure)")
    max_tokens: int = Field(16, ge=1, description="tokens the judge may answer with")
    temperature: float = Field(0.0, ge=0, description="judge sampling temperature (0: greedy)")
    max_model_len: int = Field(2048, ge=64, description="vLLM max_model_len: prompt (question, reference, "
                               "response; cut on the left) + answer")


class HttpSettings(BaseModel):
    """A user's scoring service: POST a JSON batch, get a score per item (docs/rewards.md)."""
    model_config = ConfigDict(extra="forbid")
    url: str = Field(..., description="endpoint the batches are POSTed to")
    concurrency: int = Field(4, ge=1, description="requests in flight at once")
    batch_size: int = Field(16, ge=1, description="items per request")
    timeout_s: float = Field(30.0, gt=0, description="deadline of one request, all of it: connect, send, wait "
                             "and read the whole reply (not each phase on its own)")
    max_reply_bytes: int = Field(8 << 20, ge=1024, description="largest reply read; a longer one fails the request "
                                 "(read no further)")
    retries: int = Field(3, ge=0, description="attempts after the first for a request that failed")
    backoff_s: float = Field(0.5, gt=0, description="wait before the first retry (doubles, at most 10 s)")
    headers: dict[str, str | SecretRef] = Field(default_factory=dict, description="extra request headers; a secret "
                                               "one (Authorization, a token, an API key...) must be {env: NAME} or "
                                               "{file: PATH} (0600), read when the replica starts (laminar/secrets.py)")

    @field_validator("headers")
    @classmethod
    def _no_secret_in_config(cls, headers):
        no_literal_secret(headers, "roles.reward.http.headers")
        return headers


class RewardRoleConfig(BaseModel):
    """Settings of one reward replica (`roles.reward`)."""
    model_config = ConfigDict(extra="forbid")
    scorer: str = Field("model", description="name of the score this replica computes (a rollout `rewards` term "
                        "{role: NAME})")
    backend: Literal["classifier", "judge", "http"] = Field("classifier", description="how trajectories are scored")
    classifier: ClassifierSettings | None = Field(None, description="backend classifier's settings")
    judge: JudgeSettings | None = Field(None, description="backend judge's settings")
    http: HttpSettings | None = Field(None, description="backend http's settings")
    text: TextSettings = Field(default_factory=TextSettings, description="decoding token ids to text (judge, http)")
    partial_pool: str = Field("0", description="id of the partial pool the work is leased from")
    batch_size: int = Field(32, ge=1, le=8192, description="trajectories leased (and scored) at once (the partial "
                            "pool gives at most its lease_max_items and page_bytes per lease: a reply is bounded)")
    lease_s: float = Field(60.0, gt=0, description="lease of a batch: past it, the batch is handed to another replica "
                           "(set above the longest batch's scoring time)")
    prefetch: bool = Field(True, description="lease the next batch while one scores and submit while the next "
                           "scores (hides the pool round trips; `lease_s` must then cover two batches)")
    idle_wait_s: float = Field(0.2, gt=0, description="wait before asking again when no work was waiting")
    rpc_timeout_s: float = Field(10.0, gt=0, description="deadline of each partial pool call")

    @model_validator(mode="after")
    def _backend_settings(self):
        if getattr(self, self.backend) is None:
            raise ValueError(f"roles.reward: backend {self.backend} needs its settings under `{self.backend}:`")
        return self
