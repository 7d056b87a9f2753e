"""ModelSet: the trainer's models and optimizers and their lifecycle — load, state, restore.

What it holds (each None until `load()`, and which exist depends on the settings):

    model, opt           the policy and its AdamW (always; with LoRA the base frozen in
                         `lora.base_dtype` plus a peft adapter, the optimizer's only parameters)
    ref                  the frozen reference of the k3 KL (`loss.kl_coef > 0`, full weights only:
                         with LoRA the reference is the policy with its adapter off)
    lag, lag_version     a frozen copy of the weights before the newest update and the version it
                         holds (`logging.mismatch_previous_version`: mismatch.py measures the
                         one-version-stale samples against it; `sync_lag` advances it)
    critic, critic_opt   PPO's value model and its own AdamW (`algorithm: ppo`)
    moe                  RoutingReplay (routing_replay.py) patched into the routers of the policy,
                         reference and lag models (a mixture-of-experts policy; None when dense)
    params, attention_tokens   the policy's parameter count and the length at which a sequence's
                         attention costs as much as its dense layers (micro_batches.py)

Every model is built sharded (sharded_load.py: FSDP2 over the ranks of `info`; one rank keeps
the plain module), prepared before sharding with the attention kernels, activation checkpointing
and torch.compile as configured (`_prepare`). The state it hands out — `full_state` (the path of
every publish and checkpoint), `publish_state`, `save_sharded` — is the policy's (with LoRA the
adapter alone) and the critic's, with their optimizers on request; `full_state` refuses weights
with a NaN or inf (NonFiniteWeightsError). `restore` and `restore_sharded` load them back and
forget the lag copy's version (it no longer holds the weights before the restored ones).

The update (engine.py) reads these models and steps these optimizers; nothing here trains.
"""
from __future__ import annotations

import structlog
from laminar.roles.trainer import checkpoint, context_parallel
from laminar.roles.trainer.checkpoint import check_finite
from laminar.roles.trainer.dist import DistInfo, broadcast_ints
from laminar.roles.trainer.flat_params import flatten_parameters
from laminar.roles.trainer.lora import adapter_state, manifest_fields
from laminar.roles.trainer.routing_replay import RoutingReplay
from laminar.roles.trainer.sharded_load import load_critic_model, load_model

__all__ = ["ModelSet"]
log = structlog.get_logger("laminar.trainer.engine")  # the engine's logger: its events keep their source


class ModelSet:
    """The policy, its reference, the lag copy and the critic with their optimizers: what is built
    (`load`), what state leaves (`full_state`, `publish_state`, `save_sharded`) and comes back
    (`restore`, `restore_sharded`). Every attribute is declared here; None until `load()` and,
    after it, None for a model the settings do not ask for."""

    def __init__(self, settings, seed: int, device, info: DistInfo, packing: bool):
        self.settings, self.seed, self.device, self.info = settings, seed, device, info
        # the engine forwards packed rows: the attention kernels must suit them (attn_implementation)
        self.packing = packing
        # torch.compile of the decoder layers: on by default on a GPU only
        perf = settings.performance
        self.compile = perf.compile if perf.compile is not None else device.type == "cuda"
        self.model = None         # the policy (trained)
        self.opt = None           # the policy's AdamW
        self.ref = None           # the KL's frozen reference (kl_coef > 0 with full weights)
        self.lag = None           # the weights before the newest update (mismatch_previous_version)
        self.lag_version: int | None = None  # the version `lag` holds (None: none yet, or restored)
        self.critic = None        # PPO's value model
        self.critic_opt = None    # the critic's AdamW
        self.moe: RoutingReplay | None = None  # routing replay of a mixture-of-experts policy
        self.params: int | None = None  # the policy's parameter count
        self.attention_tokens: float | None = None  # L at which L^2 / attention_tokens equals L
        self.load_reports: dict = {}  # per model: seconds, bytes, peak memory of this rank's load

    # -- load ----------------------------------------------------------------------------------
    def load(self) -> None:
        """Build every model the settings ask for, on every rank, and the optimizers."""
        import torch  # late: torch; configs validate without it

        c = self.settings
        context_parallel.setup(self.info, c.distributed.context_parallel_size)
        self.load_reports = {}
        self.model = self._load("model", trained=True, lora=c.lora)
        self.params = sum(p.numel() for p in self.model.parameters())
        mc = self.model.config  # a sequence of L tokens costs ~ L + L^2 / attention_tokens (micro_batches.py)
        self.attention_tokens = self.params / max(1, mc.num_hidden_layers * mc.hidden_size)
        if not self.info.enabled and self.device.type == "cpu" and c.lora is None:
            flatten_parameters(self.model)  # a publish is then one memcpy (flat_params.py)
        if c.loss.kl_coef > 0 and c.lora is None:  # with LoRA: the policy with its adapter off
            self.ref = self._load("reference", trained=False)
        self.lag_version = None
        if c.logging.mismatch_previous_version:
            self.lag = self._load("lag", trained=False, lora=c.lora)
        trained = [p for p in self.model.parameters() if p.requires_grad]  # with LoRA: the adapter's
        self.opt = torch.optim.AdamW(trained, lr=c.optimizer.lr, weight_decay=c.optimizer.weight_decay,
                                     **self._adamw_impl())
        self.moe = RoutingReplay.attach(c.moe, [m for m in (self.model, self.ref, self.lag) if m is not None],
                                        self.model.config)
        if self.moe is not None and self.info.cp_size > 1:
            raise ValueError("roles.trainer.distributed.context_parallel_size > 1 with a mixture-of-experts policy: "
                             "not supported (each rank's routers would see only its share of a sequence's tokens)")
        if c.algorithm == "ppo":
            self.critic, report = load_critic_model(c.model_dir, self.device, self.info,
                                                    prepare=lambda m: self._prepare(m, trained=True),
                                                    param_dtype=self._mixed_precision(),
                                                    sharded=c.distributed.sharded_load)
            self.load_reports["critic"] = report.fields()
            log.info("model_loaded", model="critic", rank=self.info.rank, **report.fields())
            self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=c.ppo.critic_lr,
                                                weight_decay=c.optimizer.weight_decay,
                                                **self._adamw_impl())

    def _mixed_precision(self):
        import torch  # late: torch; configs validate without it
        # FSDP2's mixed precision (fp32 master weights)
        return torch.bfloat16 if self.settings.performance.dtype == "bfloat16" else None

    def _load(self, name: str, trained: bool, lora=None):
        """One model, sharded (sharded_load.py): the policy (trained), the reference or the lag copy
        (frozen, eval mode); with LoRA the base in `lora.base_dtype` with a fresh adapter."""
        c = self.settings
        model, report = load_model(c.model_dir, self.device, self.info, dtype=lora.base_dtype if lora else "float32",
                                   train=trained, frozen=not trained, lora=lora, param_dtype=self._mixed_precision(),
                                   prepare=lambda m: self._prepare(m, trained), seed=self.seed,
                                   sharded=c.distributed.sharded_load)
        self.load_reports[name] = report.fields()
        log.info("model_loaded", model=name, rank=self.info.rank, **report.fields())
        return model

    def attn_implementation(self) -> str | None:
        """The attention kernels to switch the models to (None: keep what the model folder loads with)."""
        name = self.settings.performance.attn_implementation
        if name != "auto":
            return name
        if self.device.type == "cuda":
            import importlib.util  # late: only on a GPU
            if importlib.util.find_spec("flash_attn") is not None:
                return "flash_attention_2"  # varlen kernels: packed rows without a materialized mask
            if self.packing:
                # sdpa would attend a packed row of N tokens through a dense N x N block-diagonal mask
                # (N^2 work instead of the sum of L^2); flex attention skips the masked blocks
                return "flex_attention"
        return None

    def _prepare(self, model, trained: bool) -> None:
        """Before sharding: the attention kernels, and for the trained models (policy, critic body)
        activation checkpointing and torch.compile of each decoder layer, as configured."""
        c = self.settings
        impl = self.attn_implementation()
        if impl is not None and hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(impl)
        if self.info.cp_size > 1:  # attention over the CP group's whole sequence (context_parallel.py)
            context_parallel.enable(model, self.info.cp_size)
        if not trained:
            return
        if c.performance.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.compile:
            base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft's wrapper
            backbone = getattr(base, "model", base)
            for layer in getattr(backbone, "layers", []):
                layer.compile(dynamic=True)  # packed rows change length every micro-batch

    def _adamw_impl(self) -> dict:
        """AdamW's implementation: fused kernels on CUDA by default; on the CPU torch's default
        (what the trainer always used, so CPU runs are unchanged)."""
        impl = self.settings.optimizer.impl
        if impl == "auto":
            impl = "fused" if self.device.type == "cuda" else "default"
        return {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False},
                "default": {}}[impl]

    def pairs(self) -> dict:
        """The trained (module, optimizer) pairs by part: the policy's, and PPO's critic's."""
        out = {"model": (self.model, self.opt)}
        if self.critic is not None:
            out["critic"] = (self.critic, self.critic_opt)
        return out

    def sync_lag(self, weights_version: int) -> None:
        """The lag copy takes the weights the policy holds now, `weights_version` (no-op without one)."""
        if self.lag is None or self.lag_version == weights_version:
            return
        import torch  # late: torch; configs validate without it
        for m in (self.lag, self.model):  # FSDP2 may leave a root unsharded after a forward
            if hasattr(m, "reshard"):
                m.reshard()
        with torch.no_grad():
            for dst, src in zip(self.lag.parameters(), self.model.parameters(), strict=False):
                dst.copy_(src.detach())
        self.lag_version = weights_version

    # -- state ---------------------------------------------------------------------------------
    def manifest_fields(self) -> dict:
        """What a published version says it holds beyond its tensors: with LoRA the adapter's kind,
        config and base identity (lora.py); nothing for full weights."""
        if self.settings.lora is None:
            return {}
        return manifest_fields(self.model, self.settings.model_dir)

    def _model_state(self, state: dict) -> dict:
        """The policy's part of a state dict: with LoRA the adapter's tensors alone."""
        if self.settings.lora is None:
            return state
        return adapter_state(state)

    def full_state(self, with_optimizer: bool = False) -> dict | None:
        """Full (unsharded) state dicts, {part: state_dict}, on rank 0 (None elsewhere). A
        collective under FSDP2; on one rank the model's own tensors (no copy)."""
        if not self.info.enabled:
            parts = {}
            for name, (m, o) in self.pairs().items():
                parts[name] = self._model_state(m.state_dict()) if name == "model" else m.state_dict()
                if with_optimizer:
                    parts[f"{name}_optimizer" if name != "model" else "optimizer"] = o.state_dict()
            self._check_weights(parts)
            return parts
        # late: torch; configs validate without it
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        parts = {}
        for name, (m, o) in self.pairs().items():
            parts[name] = get_model_state_dict(m, options=opts)
            if name == "model":
                parts[name] = self._model_state(parts[name])
            if with_optimizer:
                key = f"{name}_optimizer" if name != "model" else "optimizer"
                parts[key] = get_optimizer_state_dict(m, o, options=opts)
        if not self.info.is_main:
            return None
        self._check_weights(parts)
        return parts

    def _check_weights(self, parts: dict) -> None:
        """Weights with a NaN or inf never leave the trainer (publish or checkpoint)."""
        check_finite({n: parts[n] for n in self.pairs() if n in parts}, "publish or checkpoint the weights")

    def restore(self, parts: dict | None) -> None:
        """Load full state dicts (read by rank 0; the others receive them by broadcast)."""
        self.lag_version = None
        if not self.info.enabled:
            for name, (m, o) in self.pairs().items():
                if name != "model" and name not in parts:
                    continue  # e.g. a GRPO checkpoint resumed with PPO: the critic starts fresh
                if name == "model" and self.settings.lora is not None:
                    from laminar.roles.trainer.lora import load_adapter_state  # late: peft, only with LoRA
                    load_adapter_state(m, parts[name])
                else:
                    m.load_state_dict(parts[name])
                o.load_state_dict(parts["optimizer" if name == "model" else f"{name}_optimizer"])
            return
        # late: torch; configs validate without it
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )
        # with LoRA the model part is the adapter alone: the frozen base is the model folder's
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True,
                                strict=self.settings.lora is None)
        parts = parts or {}
        flags = broadcast_ints(self.info, [int(n in parts) for n in self.pairs()])  # rank 0 read the files
        have = {n for n, flag in zip(self.pairs(), flags, strict=False) if flag}
        for name, (m, o) in self.pairs().items():
            if name != "model" and name not in have:
                continue
            msd = parts.get(name, {})
            if name == "model" and self.settings.lora is not None:
                from laminar.roles.trainer.lora import model_keys  # late: peft, only with LoRA
                msd = model_keys(msd)
            set_model_state_dict(m, msd, options=opts)
            key = "optimizer" if name == "model" else f"{name}_optimizer"
            set_optimizer_state_dict(m, o, parts.get(key, {}), options=opts)

    def publish_state(self) -> dict:
        """The model's state dict as this rank holds it, for a sharded publish (sharded_publish.py):
        its own tensors, DTensor shards under FSDP2; no gather, no copy. The publish checks them."""
        return self._model_state(self.model.state_dict())

    def save_sharded(self, root, version: int, state: dict, keep: int):
        """Collective: a checkpoint of every rank's shards (torch.distributed.checkpoint) under
        rank 0's `root`; its path on rank 0, None elsewhere."""
        return checkpoint.save_sharded(root, version, self.pairs(), self.info, state, keep)

    def restore_sharded(self, path) -> None:
        """Collective: load a sharded checkpoint, whatever number of ranks wrote it."""
        self.lag_version = None
        checkpoint.load_sharded(path, self.pairs(), self.info)
