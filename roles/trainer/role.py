"""TrainerRole: GRPO on whole groups from the experience buffer; one version per global batch.

    setup: seed, load the model (and a frozen reference when kl_coef > 0), AdamW; resume from the
           newest complete checkpoint (model, optimizer, RNGs, version, buffer cursor); connect to
           the experience buffer; start the WeightPublisher towards the master relay
    loop:  SampleGroups until groups_per_batch whole groups are held (a short buffer is asked
           again after sample_wait_s) -> `step_started` -> minibatch_steps optimizer steps (in a
           worker thread, so the loop keeps heartbeating) -> version += 1 -> publish (only the
           copy into staging is waited for: `published` logs that stall) -> metrics -> every
           checkpoint_every versions an atomic checkpoint -> next iteration at once.
The relay tier's progress is watched by a thread that logs `publish_delivered` when the master
holds a version, so the logs show the next `step_started` before the previous version's delivery.
Every event also goes to `self.events` (in order), which in-process tests read.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from laminar.bus.errors import RpcError
from laminar.protocol import BufferStatsRequest, Metrics, SampleGroups
from laminar.roles.base import Role
from laminar.roles.trainer import checkpoint
from laminar.roles.trainer.config import TrainerConfig
from laminar.roles.trainer.metrics import MetricsLog, batch_stats


class TrainerRole(Role):
    name = "trainer"
    Config = TrainerConfig

    def __init__(self, ctx):
        super().__init__(ctx)
        self.version = 0
        self.cursor = 0
        self.state = "starting"
        self.events: list[tuple[str, dict]] = []
        self.publisher = None
        self.follower = None
        self.last_stall_s = 0.0
        self._watch_stop = threading.Event()

    # -- helpers --------------------------------------------------------------------------
    def workdir(self) -> Path:
        base = self.ctx.config.workdir() if self.ctx.config is not None else Path("runs/run")
        return base / ("trainer" if self.ctx.id == "0" else f"trainer-{self.ctx.id}")

    def event(self, name: str, **fields) -> None:
        self.events.append((name, fields))
        self.log.info(name, **fields)

    def settings(self):
        from laminar.algorithms.grpo import GRPOSettings
        c = self.cfg
        return GRPOSettings(c.eps_low, c.eps_high, c.kl_coef, c.old_logprobs, c.off_policy, c.is_cap)

    # -- setup ----------------------------------------------------------------------------
    async def setup(self) -> None:
        c, cfg = self.cfg, self.ctx.config
        self.loop = asyncio.get_running_loop()
        self.dir = self.workdir()
        self.metrics = MetricsLog(self.dir)
        self.ckpt_root = Path(c.checkpoint_dir) if c.checkpoint_dir else self.dir / "checkpoints"
        await asyncio.to_thread(self._load)
        self.metrics.truncate_after(self.version)
        self.buffer = self.ctx.transport.client(cfg.endpoint("experience_buffer", c.experience_buffer))
        if self.resumed_from is not None:
            lost = None
            try:
                st = await self.buffer.call(BufferStatsRequest(), timeout=5.0)
                lost = st.counts.get("handed_out", self.cursor) - self.cursor
            except RpcError:
                pass
            self.event("resumed", version=self.version, checkpoint=str(self.resumed_from), cursor=self.cursor,
                       groups_handed_out_since=lost)
        if c.publish:
            await self._start_publisher()
        self.state = "ready"
        self.event("trainer_ready", version=self.version, device=str(self.device), model=c.model_dir,
                   params=sum(p.numel() for p in self.model.parameters()))

    def _load(self) -> None:
        import torch
        import transformers
        c = self.cfg
        seed = c.seed if c.seed is not None else (self.ctx.config.run.seed if self.ctx.config else 0)
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        want = "cuda" if c.device == "auto" and torch.cuda.is_available() else ("cpu" if c.device == "auto" else c.device)
        self.device = torch.device(want)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            c.model_dir, dtype=torch.float32, local_files_only=True).to(self.device)
        self.model.train()
        self.ref = None
        if c.kl_coef > 0:
            self.ref = transformers.AutoModelForCausalLM.from_pretrained(
                c.model_dir, dtype=torch.float32, local_files_only=True).to(self.device).eval()
            self.ref.requires_grad_(False)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=c.lr, weight_decay=c.weight_decay)
        checkpoint.clean_temp(self.ckpt_root)
        self.resumed_from = checkpoint.latest(self.ckpt_root) if c.resume else None
        if self.resumed_from is not None:
            st = checkpoint.load(self.resumed_from, self.model, self.opt, map_location=self.device)
            self.version, self.cursor = int(st["version"]), int(st["cursor"])

    def _relay_address(self) -> str | None:
        c, cfg = self.cfg, self.ctx.config
        if c.relay_address:
            return c.relay_address
        if c.relay_id is not None:
            host, _ = cfg.spec("relay", c.relay_id)
            port = cfg.role_settings("relay", c.relay_id).get("data_port", 0)
            if port:
                return f"{cfg.cluster.hosts[host].address}:{port}"
        return None

    async def _start_publisher(self) -> None:
        from laminar.weights.publisher import WeightPublisher
        from laminar.weights.transport import get_transport
        from laminar.weights.wire import derive_key
        c, cfg = self.cfg, self.ctx.config
        keys = getattr(self.ctx.transport, "keys", None)
        self.publisher = WeightPublisher(c.chunk_mb << 20, get_transport(c.publish_transport, **c.publish_transport_options),
                                         derive_key(keys.secret if keys else None))
        address = self._relay_address()
        if address:
            self.publisher.set_target(address, c.relay_id or "")
        elif cfg.find("manager"):
            from laminar.weights.follow import MasterFollower
            self.follower = MasterFollower(self.publisher, self.ctx.transport, cfg.endpoint("manager", c.manager_id))
            await self.follower.start()
        else:
            raise ValueError("trainer.publish is on but there is no relay_address, relay_id with a data_port, "
                             "or manager to name the master relay")
        self._watcher = threading.Thread(target=self._watch_delivery, name="trainer-delivery", daemon=True)
        self._watcher.start()
        if self.resumed_from is None and self.version == 0:
            await self._publish()  # the initial weights are version 0

    def _watch_delivery(self) -> None:
        pub, last = self.publisher, -1
        while not self._watch_stop.is_set():
            with pub.cond:
                pub.cond.wait_for(lambda: pub.delivered > last or pub.stopped or self._watch_stop.is_set(), 0.5)
                d, stopped = pub.delivered, pub.stopped
            if stopped:
                return
            if d > last:
                last = d
                self.loop.call_soon_threadsafe(lambda v=d: self.event("publish_delivered", version=v))

    # -- main loop --------------------------------------------------------------------------
    async def run(self) -> None:
        self.state = "training"
        while not self.stopping.is_set():
            if self.cfg.max_iterations is not None and self.version >= self.cfg.max_iterations:
                self.event("training_finished", version=self.version)
                return
            groups = await self._collect()
            if groups is None:
                return
            await self._iteration(groups)

    async def _collect(self):
        need, groups, warned = self.cfg.groups_per_batch, [], 0.0
        while len(groups) < need:
            if self.stopping.is_set():
                return None
            try:
                s = await self.buffer.call(SampleGroups(need - len(groups), self.version), timeout=30.0)
            except RpcError as exc:
                if time.monotonic() - warned > 10:
                    self.log.warning("buffer_unavailable", error=str(exc))
                    warned = time.monotonic()
                await asyncio.sleep(max(self.cfg.sample_wait_s, 0.5))
                continue
            groups += s.groups
            self.cursor = s.cursor
            if len(groups) < need:
                await asyncio.sleep(self.cfg.sample_wait_s)
        return groups

    async def _publish(self) -> float:
        t0 = time.perf_counter()
        await asyncio.to_thread(self.publisher.publish, self.model.state_dict(), self.version)
        self.last_stall_s = stall = time.perf_counter() - t0
        self.event("published", version=self.version, stall_s=round(stall, 6))
        return stall

    async def _iteration(self, groups) -> None:
        self.event("step_started", version=self.version + 1, groups=len(groups))
        stats = batch_stats(groups, self.version)
        t0 = time.perf_counter()
        train = await asyncio.to_thread(self._train, groups)
        train_s = time.perf_counter() - t0
        self.version += 1
        stall = await self._publish() if self.publisher is not None else 0.0
        values = {**stats, **train, "train_s": train_s, "tokens_per_s": train["tokens"] / max(train_s, 1e-9),
                  "publish_stall_s": stall, "version": float(self.version), "cursor": float(self.cursor)}
        self.metrics.append({**values, "ts": time.time(),
                             "group_ids": [g[0].spec.group_id for g in groups]})
        self.pub.publish("metrics.trainer", Metrics(role="trainer", id=self.ctx.id, ts=time.time(), values=values))
        self.event("iteration", version=self.version, reward_mean=round(stats["reward_mean"], 4),
                   loss=round(train.get("loss", 0.0), 6), tokens_per_s=round(values["tokens_per_s"], 1),
                   publish_stall_s=round(stall, 6))
        if self.version % self.cfg.checkpoint_every == 0:
            path = await asyncio.to_thread(checkpoint.save, self.ckpt_root, self.version, self.model, self.opt,
                                           {"cursor": self.cursor}, self.cfg.keep_checkpoints)
            self.event("checkpoint_saved", version=self.version, path=str(path), cursor=self.cursor)

    # -- one global batch (worker thread) ----------------------------------------------------
    def _logprobs(self, model, trajs: list) -> list[np.ndarray]:
        import torch
        from laminar.algorithms.grpo import collate, response_logprobs, token_logprobs
        out = []
        mbs = self.cfg.micro_batch_size
        with torch.no_grad():
            for i in range(0, len(trajs), mbs):
                part = trajs[i:i + mbs]
                ids, att, _, _ = collate([t.spec.prompt_tokens for t in part], [t.response_tokens for t in part])
                lp, _ = token_logprobs(model, ids.to(self.device), att.to(self.device))
                out += response_logprobs(lp, [len(t.spec.prompt_tokens) for t in part],
                                         [len(t.response_tokens) for t in part])
        return out

    def _train(self, groups) -> dict:
        import torch
        from laminar.algorithms.grpo import collate, group_advantages, grpo_loss, token_logprobs
        c, s = self.cfg, self.settings()
        trajs = [t for g in groups for t in g]
        adv = np.concatenate(group_advantages([[t.reward for t in g] for g in groups], s.adv_eps, c.adv_std_normalize))
        per = {"beh": [np.asarray(t.logprobs, np.float32) for t in trajs]}
        if s.needs_proximal:
            per["prox"] = self._logprobs(self.model, trajs)
        if self.ref is not None:
            per["ref"] = self._logprobs(self.ref, trajs)
        valid = [int(t.loss_mask.sum()) if t.loss_mask is not None else len(t.response_tokens) for t in trajs]
        perm = torch.randperm(len(trajs)).tolist()
        totals: dict[str, float] = defaultdict(float)
        norms, tokens, counted = [], 0, 0
        for mb in np.array_split(np.array(perm), c.minibatch_steps):
            mb = mb.tolist()
            ntok = sum(valid[i] for i in mb)
            if not mb or ntok == 0:
                continue
            self.opt.zero_grad(set_to_none=True)
            for j in range(0, len(mb), c.micro_batch_size):
                idx = mb[j:j + c.micro_batch_size]
                ids, att, mask, ex = collate([trajs[i].spec.prompt_tokens for i in idx], [trajs[i].response_tokens for i in idx],
                                             {k: [v[i] for i in idx] for k, v in per.items()},
                                             [trajs[i].loss_mask for i in idx])
                ids, att, mask = ids.to(self.device), att.to(self.device), mask.to(self.device)
                ex = {k: v.to(self.device) for k, v in ex.items()}
                logp, ent = token_logprobs(self.model, ids, att, with_entropy=c.entropy_metric)
                old = ex["prox"] if s.needs_proximal else ex["beh"]
                loss, m = grpo_loss(logp, old, torch.as_tensor(adv[idx], device=self.device), mask,
                                    eps_low=s.eps_low, eps_high=s.eps_high, behaviour_logp=ex["beh"],
                                    off_policy=s.off_policy, is_cap=s.is_cap, ref_logp=ex.get("ref"),
                                    kl_coef=s.kl_coef, num_tokens=ntok, entropy=ent)
                loss.backward()
                for k, v in m.items():
                    totals[k] += v * ntok
                tokens += int(att.sum())
            norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.max_grad_norm)))
            self.opt.step()
            counted += ntok
        out = {k: v / max(counted, 1) for k, v in totals.items()}
        out.update(grad_norm=float(np.mean(norms)) if norms else 0.0, grad_norm_max=float(max(norms, default=0.0)),
                   tokens=float(tokens), response_tokens=float(counted), advantage_abs_mean=float(np.abs(adv).mean()))
        return out

    # -- lifecycle ----------------------------------------------------------------------------
    async def stop(self) -> None:
        await super().stop()
        self._watch_stop.set()
        if self.follower is not None:
            await self.follower.close()
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.close)

    def status(self) -> dict:
        return {"version": self.version, "state": self.state, "cursor": self.cursor,
                "publish_stall_s": round(self.last_stall_s, 6),
                "delivered": self.publisher.delivered if self.publisher is not None else None}
