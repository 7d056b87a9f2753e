"""TrainerConfig: every setting of the trainer role, with its meaning, in sections.

    roles.trainer:
      model_dir, engine, sim, algorithm, groups_per_batch, minibatch_steps, max_iterations, seed,
      device, experience_buffer, lora      what is trained, on what, for how long
      optimizer:    lr, warmup_versions, weight_decay, max_grad_norm, impl
      loss:         eps_low, eps_high, dual_clip, dual_clip_c, kl_coef, adv_std_normalize,
                    skip_uniform_groups, filter_groups, old_logprobs, off_policy, is_level, is_cap,
                    is_low
      ppo:          gamma, lam, critic_lr, value_clip, whiten_advantages     (algorithm: ppo)
      performance:  sample_wait_s, dtype, packing, attn_implementation, activation_checkpointing,
                    compile, micro_batch_size, max_tokens_per_micro_batch, micro_batch_balance,
                    logprob_chunk_tokens                 how the update is computed, not what it is
      checkpoint:   every, keep, dir, keep_best, resume, export_dir
      distributed:  world_size, rank, address, port, timeout_s,                (FSDP2 ranks)
                    context_parallel_size, sharded_load
      publishing:   enabled, relay_id, relay_address, manager_id, transport, transport_options,
                    chunk_mb, overlap, dtype                  how each version reaches the relays
      logging:      samples_every, samples, tensorboard, entropy, mismatch_previous_version,
                    record_members
      moe:          routing_replay, router_aux_loss_coef          (mixture-of-experts policies)

A key of the older flat layout (`roles.trainer.lr`) is refused with its new path (`MOVED`, read
by laminar/config.py: "roles.trainer.lr: moved to roles.trainer.optimizer.lr").
"""
from __future__ import annotations

from typing import ClassVar

from laminar.roles.trainer.moe_settings import TrainerMoe
from laminar.roles.trainer.sim_settings import SimTrainerSettings
from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """A section of the trainer's settings: any unknown key is an error."""
    model_config = ConfigDict(extra="forbid")


class FilterGroups(Section):
    """Dynamic sampling: which groups count toward a global batch (docs/learning.md)."""
    metric: str = Field("reward", pattern="^(reward|accuracy)$", description="the per-sample value whose spread "
                        "makes a group informative: reward, or accuracy (1 when the reward is >= 1)")
    min_std: float = Field(0.0, ge=0, description="a group is kept when the population std of its metric is above "
                           "this (0: any spread)")
    max_dropped: int | None = Field(None, ge=0, description="most groups one version may drop for no signal before "
                                    "it trains on what the buffer hands out next, informative or not (logged as "
                                    "filter_cap_reached); None: 3 x groups_per_batch")


class LoraSettings(Section):
    """roles.trainer.lora: train a LoRA adapter (peft) on a frozen base instead of every weight."""
    rank: int = Field(16, ge=1, description="the adapter's rank r (rollouts need max_lora_rank >= r)")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha: the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input (0 keeps the trainer's "
                           "logprobs those of the rollouts' adapter)")
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"],
                                      description="names of the linear layers that get an adapter")
    base_dtype: str = Field("float32", pattern="^(float32|bfloat16|float16)$",
                            description="dtype of the frozen base weights: the rollouts' serving dtype (the "
                            "adapter's own weights and their optimizer states stay float32)")


class OptimizerSettings(Section):
    """roles.trainer.optimizer: the policy's AdamW and its learning-rate schedule."""
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate")
    warmup_versions: int = Field(0, ge=0, description="linear learning-rate warm-up: version v (1-based) trains at "
                                 "lr * min(1, v / warmup_versions); 0: none. Stateless (a resumed run continues it "
                                 "from its version)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping (the pre-clip norm is logged)")
    impl: str = Field("auto", pattern="^(auto|fused|foreach|for_loop)$",
                      description="AdamW implementation; auto: fused on CUDA, torch's default on the CPU")


class LossSettings(Section):
    """roles.trainer.loss: the policy loss, which groups it trains on, and its off-policy corrections."""
    eps_low: float = Field(0.2, ge=0, description="Clip-Higher lower bound: ratio >= 1 - eps_low")
    eps_high: float = Field(0.28, ge=0, description="Clip-Higher upper bound: ratio <= 1 + eps_high")
    dual_clip: bool = Field(False, description="dual clip: the loss of a negative-advantage token is at most "
                            "dual_clip_c * |A| (bounds stale tokens whose ratio exploded)")
    dual_clip_c: float = Field(3.0, gt=1, description="the dual clip's bound c (used when dual_clip is on)")
    kl_coef: float = Field(0.0, ge=0, description="weight of the k3 KL to a frozen reference (0: no reference model)")
    adv_std_normalize: bool = Field(True, description="divide group advantages by the group's std")
    skip_uniform_groups: bool = Field(True, description="grpo: leave out of the batch's loss every group whose "
                                      "rewards are all equal (zero advantages: no signal, but their tokens would "
                                      "dilute the token mean); a batch of only such groups makes no optimizer step "
                                      "(Adam's momentum would move the weights on a zero gradient). Counted in the "
                                      "version's groups_uniform and no_signal_steps")
    filter_groups: FilterGroups | None = Field(None, description="dynamic sampling: a group whose metric has no "
                                               "spread never counts toward a global batch; the experience buffer "
                                               "drops it and the trainer waits for informative ones (the prompt "
                                               "pool hands out replacements), up to max_dropped a version; None: "
                                               "off")
    old_logprobs: str = Field("behaviour", pattern="^(behaviour|recompute)$",
                              description="old policy of the ratio: the rollout's behaviour logprobs or recomputed "
                                          "by the trainer")
    off_policy: str = Field("none", pattern="^(none|tis|mis|decoupled)$",
                            description="stale-sample correction (laminar/algorithms/off_policy.py): tis (truncated "
                                        "IS), mis (masked IS: tokens or sequences whose ratio leaves [is_low, is_cap] "
                                        "are dropped) or decoupled PPO; each recomputes the proximal policy")
    is_level: str = Field("token", pattern="^(token|sequence|geometric)$",
                          description="the importance ratio of tis, mis and decoupled: per token, per sequence (the "
                                      "product of its tokens' ratios) or geometric (that product's per-token mean)")
    is_cap: float | None = Field(2.0, gt=0, description="truncation of the importance weight (tis; optional for "
                                 "decoupled) and the top of mis's band")
    is_low: float | None = Field(None, gt=0, description="the bottom of mis's band (None: 1 / is_cap)")


class PpoSettings(Section):
    """roles.trainer.ppo: the critic and GAE of `algorithm: ppo` (unused by grpo)."""
    gamma: float = Field(1.0, ge=0, le=1, description="discount of the token-level MDP")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda")
    critic_lr: float = Field(1e-5, gt=0, description="AdamW learning rate of the critic")
    value_clip: float | None = Field(0.2, gt=0, description="clip of the value update around the old values "
                                     "(None: no clip)")
    whiten_advantages: bool = Field(True, description="normalize GAE advantages over the batch's valid tokens")


class PerformanceSettings(Section):
    """roles.trainer.performance: how the update is computed (precision, kernels, memory savers,
    micro-batches); apart from dtype none changes what is learned."""
    sample_wait_s: float = Field(0.05, gt=0, description="wait before asking a short buffer again")
    dtype: str = Field("float32", pattern="^(float32|bfloat16)$",
                       description="compute dtype: bfloat16 runs forward/backward under autocast (and, "
                                   "with world_size > 1, FSDP2's mixed precision: bf16 all-gathered parameters, "
                                   "fp32 gradient reduction); parameters, gradients and optimizer states stay "
                                   "float32")
    packing: bool | None = Field(None, description="pack each micro-batch's sequences into one row with "
                                 "per-sequence positions (no compute on padding; flash-attention varlen on a GPU, "
                                 "a block-diagonal mask on the CPU); None: on with CUDA, off on the CPU")
    attn_implementation: str = Field("auto", pattern="^(auto|sdpa|eager|flex_attention|flash_attention_2|"
                                     "flash_attention_3)$",
                                     description="the models' attention kernels; auto: on CUDA flash_attention_2 "
                                     "when the flash_attn package is installed, else flex_attention when packing "
                                     "(block-sparse; sdpa would compute a packed row's whole N x N mask), else "
                                     "what the model folder loads with (sdpa)")
    activation_checkpointing: bool = Field(False, description="recompute each decoder layer's activations in the "
                                           "backward (less memory, ~1/3 more compute)")
    compile: bool | None = Field(None, description="torch.compile each decoder layer (the first steps compile); "
                                 "None: on with CUDA (flex attention, which packing uses without flash_attn, is "
                                 "unusably slow uncompiled), off on the CPU")
    trim_heap: bool = Field(True, description="on the CPU, give the C allocator's free pages back to the kernel "
                            "after each step (glibc malloc_trim; metric heap_trimmed_bytes): without it the "
                            "resident set keeps each batch's differently shaped activations and grows")
    micro_batch_size: int = Field(64, ge=1, description="most sequences per forward/backward (gradient "
                                  "accumulation)")
    max_tokens_per_micro_batch: int | None = Field(None, ge=1, description="token budget of one forward/backward: "
                                                   "a micro-batch holds sequences up to this many tokens (packed: "
                                                   "their sum; padded: their count x the longest), a longer "
                                                   "sequence alone; None: micro-batches cut by micro_batch_size only")
    micro_batch_balance: str = Field("tokens", pattern="^(tokens|attention|round_robin)$",
                                     description="how a mini-batch's sequences are dealt to ranks and micro-batches "
                                     "(roles/trainer/micro_batches.py): tokens (a Karmarkar-Karp partition of their "
                                     "token counts into ranks x micro-batches, every rank the same number of "
                                     "micro-batches), attention (the same, each sequence's cost L + L^2 / A with "
                                     "A = parameters / (layers x hidden): attention's share of the FLOPs), or "
                                     "round_robin (rank r takes sequences r, r+W, ... by count, as before)")
    logprob_chunk_tokens: int = Field(1024, ge=0, description="compute logprobs and entropies from the last hidden "
                                      "state this many tokens at a time, forward and backward, never the full "
                                      "[tokens, vocabulary] logits (roles/trainer/logprobs.py); 0: the full "
                                      "float32 logits and log-softmax")


class CheckpointSettings(Section):
    """roles.trainer.checkpoint: when checkpoints are written, how many are kept, resuming, export."""
    every: int = Field(10, ge=1, description="checkpoint every N versions")
    keep: int = Field(2, ge=1, description="complete checkpoints kept")
    dir: str | None = Field(None, description="default <workdir>/trainer[-<id>]/checkpoints")
    keep_best: bool = Field(False, description="copy the checkpoint of the version the evaluator scores best (its "
                            "best_metric) to <workdir>/trainer[-<id>]/best/, out of rotation's reach "
                            "(roles/trainer/best.py; only versions that have a checkpoint count)")
    resume: bool = Field(True, description="start from the newest complete checkpoint when there is one")
    export_dir: str | None = Field(None, description="at the end of a run (max_iterations reached), write the "
                                   "final weights there as a Hugging Face folder, as `laminar-node export` writes one "
                                   "(config and tokenizer files of model_dir, weights in its config's dtype); "
                                   "None: none")


class DistributedSettings(Section):
    """roles.trainer.distributed: the ranks of one trainer (FSDP2) and where they meet."""
    world_size: int = Field(1, ge=1, description="ranks of this trainer (FSDP2); each rank is its own trainer role")
    rank: int | None = Field(None, ge=0, description="this process's rank (default: the role id, which must then be "
                             "0..world_size-1)")
    address: str | None = Field(None, description="host:port where the ranks meet (default: rank 0's host address "
                                "and port)")
    port: int = Field(29500, ge=1, le=65535, description="rendezvous port on rank 0's host when address is not given")
    timeout_s: float = Field(1800.0, gt=0, description="deadline of one collective (a follower waits this long for "
                             "a batch)")
    context_parallel_size: int = Field(1, ge=1, description="ranks that split one sequence's tokens (Ulysses: "
                                       "an all-to-all over attention heads in each layer; "
                                       "roles/trainer/context_parallel.py). Must divide world_size, the model's "
                                       "attention heads, and its key/value heads or be a multiple of them; the "
                                       "world_size / context_parallel_size data-parallel groups train their own "
                                       "micro-batches; 1: off")
    sharded_load: bool = Field(True, description="build the models on the meta device, shard them, and let each "
                               "rank read only its own rows from the safetensors files "
                               "(roles/trainer/sharded_load.py); false, or a folder without safetensors files: "
                               "every rank loads the whole model and shards it afterwards")


class PublishingSettings(Section):
    """roles.trainer.publishing: how each version reaches the master relay."""
    enabled: bool = Field(True, description="publish every version to the master relay")
    relay_id: str | None = Field(None, description="master relay id, used when the cluster has no manager (with "
                                 "one, the trainer follows the manager's master); its data address is "
                                 "<host address>:<relay data_port>")
    relay_address: str | None = Field(None, description="explicit host:port of the master relay's data listener")
    manager_id: str = Field("0", description="manager to follow for the current master (used when a manager is "
                            "placed and no address is given)")
    transport: str = Field("tcp", description="chunk transport: tcp, ucx, or module:Class")
    transport_options: dict = Field(default_factory=dict, description="keyword arguments of the transport")
    chunk_mb: int = Field(16, ge=1, description="chunk size of the weight stream, MiB. A relay forwards a chunk "
                          "once all of it arrived and its digest checked, so a chain of K relays adds K - 1 chunks' "
                          "transfer time to each version: at most 1/(20 K) of a version keeps that under 5%")
    overlap: bool = Field(True, description="one-rank trainer on a GPU: queue the publish's copies and return, so "
                          "they run during the next forward/backward (the next optimizer step waits for them on the "
                          "GPU); false: wait for the copies in the publish")
    dtype: str | None = Field("rollout", pattern="^(rollout|same|float32|bfloat16|float16)$",
                              description="dtype of published floating-point weights, cast on the trainer's device "
                              "before the copy: rollout (the rollouts' engine dtype when they all agree, else same), "
                              "same/None (the parameters' dtype), or a dtype")


class LoggingSettings(Section):
    """roles.trainer.logging: what the trainer records beyond its metrics.jsonl."""
    samples_every: int = Field(10, ge=0, description="every this many versions, write `samples` rows of the trained "
                               "batch (prompt, response, reward, version, staleness) to <workdir>/samples.jsonl "
                               "(laminar/samples.py); 0: never")
    samples: int = Field(4, ge=1, description="rows a version writes when it logs samples")
    tensorboard: bool = Field(True, description="also write TensorBoard curves when tensorboardX is installed")
    entropy: bool = Field(True, description="log the policy entropy on response tokens")
    mismatch_previous_version: bool = Field(True, description="train-inference mismatch of one-version-stale "
                                            "samples too: keeps a frozen copy of the weights before the newest "
                                            "update (one more model in memory, one no-grad forward of those samples)")
    record_members: bool = Field(False, description="write every trained sample's trajectory id, rollout and run "
                                 "into its version's metrics.jsonl record (`members`), for audits that check who "
                                 "wrote what was trained (the hostile chaos run); off by default: one entry per "
                                 "sample, 8,192 a version at a batch of 512 prompts x 16")


class TrainerConfig(BaseModel):
    """Settings of the trainer: what is trained and for how long at the top, then one section per
    concern (optimizer, loss, ppo, performance, checkpoint, distributed, publishing, logging)."""
    model_config = ConfigDict(extra="forbid")
    model_dir: str = Field(description="local Hugging Face causal-LM folder (Qwen2/Llama); nothing is downloaded")
    engine: str = Field("torch", pattern="^(torch|sim)$", description="torch (real training) or sim (the scale "
                        "simulator's trainer: modeled time per iteration, no model; roles/trainer/sim_engine.py)")
    sim: SimTrainerSettings | None = Field(None, description="engine: sim: what the simulated trainer costs and how "
                                           "its versions travel (roles/trainer/sim_settings.py); needed then")
    algorithm: str = Field("grpo", pattern="^(grpo|ppo)$",
                           description="grpo: group-normalized advantages; ppo: a critic (value head) and GAE "
                                       "advantages (settings in `ppo`)")
    groups_per_batch: int = Field(8, ge=1, description="whole GRPO groups per global batch (= one version)")
    minibatch_steps: int = Field(1, ge=1, description="optimizer steps per global batch (the batch is split evenly)")
    max_iterations: int | None = Field(None, ge=1, description="finish (exit 0) after this version (None: run until "
                                       "stopped)")
    seed: int | None = Field(None, description="seed of torch/numpy/python RNGs (default run.seed)")
    device: str = Field("auto", pattern="^(auto|cpu|cuda)$", description="auto: cuda when available")
    experience_buffer: str = Field("0", description="id of the experience buffer to sample from")
    lora: LoraSettings | None = Field(None, description="train a LoRA adapter on the frozen base and publish "
                                      "the adapter alone (roles/trainer/lora.py, docs/lora.md); None: full fine-tuning")
    optimizer: OptimizerSettings = Field(default_factory=OptimizerSettings, description="the policy's optimizer")
    loss: LossSettings = Field(default_factory=LossSettings, description="the policy loss and its corrections")
    ppo: PpoSettings = Field(default_factory=PpoSettings, description="algorithm: ppo: critic and GAE")
    performance: PerformanceSettings = Field(default_factory=PerformanceSettings,
                                             description="precision, kernels, memory savers, micro-batches")
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings, description="checkpoints and export")
    distributed: DistributedSettings = Field(default_factory=DistributedSettings,
                                             description="FSDP2 ranks, context parallelism, the sharded load")
    publishing: PublishingSettings = Field(default_factory=PublishingSettings,
                                           description="how versions reach the master relay")
    logging: LoggingSettings = Field(default_factory=LoggingSettings, description="samples, curves, extra metrics")
    moe: TrainerMoe = Field(default_factory=TrainerMoe, description="mixture-of-experts policies: routing replay "
                            "of the rollouts' recorded experts, the load-balancing loss (docs/moe.md)")

    # the older flat layout: key -> its path now (laminar/config.py names it in the error)
    MOVED: ClassVar[dict[str, str]] = {
        **{k: f"optimizer.{k}" for k in ("lr", "weight_decay", "max_grad_norm")},
        "lr_warmup_versions": "optimizer.warmup_versions", "optimizer_impl": "optimizer.impl",
        **{k: f"loss.{k}" for k in ("eps_low", "eps_high", "dual_clip", "dual_clip_c", "kl_coef", "adv_std_normalize",
                                    "skip_uniform_groups", "filter_groups", "old_logprobs", "off_policy", "is_cap",
                                    "is_level", "is_low")},
        **{k: f"ppo.{k}" for k in ("gamma", "lam", "critic_lr", "value_clip", "whiten_advantages")},
        **{k: f"performance.{k}" for k in ("dtype", "packing", "attn_implementation", "activation_checkpointing",
                                           "compile", "micro_batch_size", "max_tokens_per_micro_batch",
                                           "micro_batch_balance", "logprob_chunk_tokens")},
        "checkpoint_every": "checkpoint.every", "keep_checkpoints": "checkpoint.keep",
        "checkpoint_dir": "checkpoint.dir", "keep_best_checkpoint": "checkpoint.keep_best",
        "resume": "checkpoint.resume", "export_dir": "checkpoint.export_dir",
        "sample_wait_s": "performance.sample_wait_s",
        "world_size": "distributed.world_size", "rank": "distributed.rank", "dist_address": "distributed.address",
        "dist_port": "distributed.port", "dist_timeout_s": "distributed.timeout_s",
        "publish": "publishing.enabled", "relay_id": "publishing.relay_id", "relay_address": "publishing.relay_address",
        "manager_id": "publishing.manager_id", "publish_transport": "publishing.transport",
        "publish_transport_options": "publishing.transport_options", "chunk_mb": "publishing.chunk_mb",
        "publish_overlap": "publishing.overlap", "publish_dtype": "publishing.dtype",
        "log_samples_every": "logging.samples_every", "log_samples": "logging.samples",
        "tensorboard": "logging.tensorboard", "entropy_metric": "logging.entropy",
        "mismatch_previous_version": "logging.mismatch_previous_version",
        "record_members": "logging.record_members",
    }

    @model_validator(mode="after")
    def _context_parallel_fits(self) -> TrainerConfig:
        """context_parallel_size must divide world_size, and the model's heads where its shape is known."""
        cp, world = self.distributed.context_parallel_size, self.distributed.world_size
        if cp > 1 and world % cp:
            raise ValueError(f"distributed.context_parallel_size {cp} must divide distributed.world_size {world}")
        if cp > 1 and self.engine == "torch":
            from laminar.models.shape import model_shape  # late: only with CP (reads the model folder)
            shape = model_shape(self.model_dir)
            if shape is not None and (shape.heads % cp or (shape.kv_heads % cp and cp % shape.kv_heads)):
                raise ValueError(f"distributed.context_parallel_size {cp} must divide the model's {shape.heads} "
                                 f"attention heads, and its {shape.kv_heads} key/value heads or be a multiple of "
                                 f"them ({shape.source})")
        return self
