"""SimTrainEngine: the scale simulator's trainer (docs/sim.md), selected by `roles.trainer.engine: sim`.

It stands in for TrainEngine behind the trainer role: the role still samples whole groups from
the real experience buffer, counts versions, writes the same metrics records (reward, staleness,
batch_tokens, version, ts) and publishes every version; only the torch work is replaced by time.

    roles.trainer: {engine: sim, model_dir: sim, publishing: {enabled: false},
                    sim: {model: 72B, gpus: 768, gpu: H800, mfu: 0.35, recompute: true, speedup: 20,
                          relay: {bandwidth_gbps: 200, chunk_mib: 64, alpha_s: 0.001},
                          deliver: [{host: n0, dir: /dev/shm/..-n0}, ...]}}

Time (compressed, like the rollouts' CompressedClock): one iteration sleeps
`TrainerCost.iteration_s(tokens)` ÷ speedup of real time in the role's worker thread, for the
batch's actual prompt + response tokens (laminar/sim/trainer_cost.py: 6·P·T, × 4/3 with
recomputation, at `mfu` of `gpus` × the GPU's bf16 peak; the slowest data-parallel rank of each
optimizer step; FSDP traffic, the single controller's work and colocated phase switches where
set). The publish stall (pushing the bf16 weights into the master relay, S/B; or, with `nccl`, a
blocking NCCL broadcast that the rollouts wait out too) is slept too, so the trainer's update
period is iteration + stall.

Weights: a version is a few KB (`weight_bytes`), never the model's size. Two ways to deliver it:
- through the real relay tier (relays placed, `publishing.enabled: true`): `full_state()` sleeps the stall
  and returns a tiny state dict that the role's PublishLink streams down the real chain; the
  relays announce `weights.version` and the rollouts pull from their host's shared memory. This
  imports torch (the publisher stages torch tensors).
- modeled, without relays (`sim.deliver` lists the hosts' weight folders in chain order, and
  `publishing.enabled: false`): the engine itself writes each version into host i's folder (the same
  shared-memory store format a relay writes, so the rollouts' LocalWeights reads it) when the
  relay model says it arrives there — S/B for the master, + (i − 1)(c/B + α) for the i-th host
  (the relay chain), so the last of p hosts has it after `broadcast_s(p)` — and publishes
  `weights.version` as that host's relay would. No torch, no threads per relay: at the paper's
  scale (up to 96 rollout hosts) the real chain's Python-side latency, multiplied by the
  speedup, would dominate the modeled second or so.

There is nothing to checkpoint: the role skips checkpoints for this engine, and a restart starts
from version 0.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from laminar.roles.trainer.sim_settings import DeliverTarget, SimTrainerSettings

from laminar.protocol import WeightsVersion
from laminar.sim.reward_cost import RewardCost
from laminar.sim.trainer_cost import NcclBroadcast, RelayLink, TrainerCost
from laminar.weights.local_write import begin_local, commit_local
from laminar.weights.manifest import build_manifest
from laminar.weights.store import ShmStore


class SimTrainEngine:
    """The simulator's training engine: implements TrainEngineAPI (roles/trainer/engine_api.py:
    load, params, train, full_state, restore) with modeled time instead of torch work."""

    params: int
    delivery: ModeledDelivery | None = None

    @classmethod
    def from_trainer_config(cls, settings, publish: Callable[[str, Any], None] | None = None,
                            stopping: asyncio.Event | None = None) -> SimTrainEngine:
        """The engine for the trainer role's settings (`TrainerConfig`: `sim`, `publishing.enabled`,
        `loss.old_logprobs`): its cost model, and with `sim.deliver` the modeled delivery, which writes
        version 0 into every host's folder now and announces each version through `publish`
        (topic, event) until `stopping` is set. Call it on the role's event loop."""
        if settings.distributed.world_size > 1:
            raise ValueError(f"roles.trainer: engine sim models one trainer process (world_size 1, not "
                             f"{settings.distributed.world_size}); its cost model already spreads the work over the "
                             "simulated GPUs")
        s = settings.sim
        if s is None:
            raise ValueError("roles.trainer.sim: engine sim needs the simulated trainer's settings (model, gpus, ...)")
        if s.deliver is not None and settings.publishing.enabled:
            raise ValueError("roles.trainer.sim.deliver (modeled delivery) needs roles.trainer.publishing.enabled: "
                             "false; with publishing enabled versions go through the real relay tier")
        extra = old_logprob_passes(settings)
        if extra:
            s = s.model_copy(update={"extra_forward_passes": s.extra_forward_passes + extra})
        engine = cls(s)
        if s.deliver is not None:
            if publish is None:
                raise ValueError("modeled delivery (roles.trainer.sim.deliver) needs a publish function")
            delivery = ModeledDelivery(publish, stopping or asyncio.Event(), s, engine.cost,
                                       asyncio.get_running_loop())
            engine.on_version, engine.delivery = delivery.from_thread, delivery
            for target in s.deliver:  # version 0 (the initial weights) is on every host at start
                delivery.deliver(target, 0)
        return engine

    def describe(self) -> dict:
        """The engine's settings and modeled costs, for the role's start-up log."""
        s = self.s
        return {"model": s.model, "gpus": s.gpus, "gpu": s.gpu, "mfu": s.mfu, "recompute": s.recompute,
                "speedup": s.speedup, "stall_s": round(self.stall_s, 4), "params": self.params,
                "extra_forward_passes": s.extra_forward_passes,
                "delivery": "modeled" if s.deliver is not None else "relay",
                "broadcast_s": round(self.cost.broadcast_s(max(1, len(s.deliver or []))), 4)}

    def __init__(self, settings: SimTrainerSettings, on_version=None):
        s = self.s = settings
        self.cost = TrainerCost.build(s.model, s.gpu, s.gpus, mfu=s.mfu, recompute=s.recompute,
                                      extra_forward_passes=s.extra_forward_passes,
                                      link=RelayLink(s.relay.bandwidth_gbps, s.relay.chunk_mib, s.relay.alpha_s),
                                      fsdp=s.fsdp, sp=s.sp, optimizer_steps=s.optimizer_steps,
                                      collective_gbps=s.collective_gbps,
                                      controller_s_per_trajectory=s.controller_s_per_trajectory,
                                      controller_fixed_s=s.controller_fixed_s, switch_s=s.switch_s,
                                      attention=s.attention,
                                      reward=RewardCost.from_points(s.reward_s_by_tokens) if s.reward_s_by_tokens
                                      else None)
        self.params = self.cost.model.params
        if s.colocated:
            self.stall_s = 0.0
        elif s.nccl is not None:
            self.stall_s = NcclBroadcast(s.nccl.bandwidth_gbps, s.nccl.per_doubling_gbps).seconds(
                self.cost.model.weight_bytes(), s.nccl.rollout_gpus)
        else:
            self.stall_s = self.cost.publish_stall_s()
        self.on_version = on_version  # modeled delivery: called (worker thread) with each new version
        self.sim_busy_s = 0.0         # simulated seconds spent training + stalled, in total

    # -- TrainEngine interface -------------------------------------------------------------------
    def load(self) -> None:
        pass

    def restore(self, parts) -> None:
        pass

    def train(self, groups, version: int) -> dict:
        """Sleep one iteration's modeled time (worker thread); in modeled-delivery mode also the
        publish stall, after which version `version` starts down the modeled chain."""
        trajectories = [t for g in groups for t in g]
        responses = [len(t.response_tokens) for t in trajectories]
        lengths = [len(t.spec.prompt_tokens) + n for t, n in zip(trajectories, responses, strict=True)]
        tokens = sum(lengths)
        if self.s.balance:
            train_s = self.cost.iteration_s_lengths(lengths, responses)
        else:
            train_s = self.cost.iteration_s(tokens, len(lengths), squares=sum(n * n for n in lengths),
                                            response_lengths=responses)
        stall_s = self.stall_s if self.on_version is not None else 0.0
        nccl = self.s.nccl is not None
        time.sleep(train_s / self.s.speedup)
        if self.on_version is not None and nccl:  # a blocking broadcast: every host has it as it begins
            self.on_version(version)
        time.sleep(stall_s / self.s.speedup)
        self.sim_busy_s += train_s + stall_s
        if self.on_version is not None and not nccl:
            self.on_version(version)
        scoring_s = self.cost.reward.total(responses) if self.cost.reward is not None else 0.0
        return {"tokens": float(tokens), "loss": 0.0, "sim_train_s": train_s, "sim_stall_s": self.stall_s,
                "speedup": self.s.speedup, "sim_scoring_s": scoring_s}

    def full_state(self, with_optimizer: bool = False) -> dict:
        """The stand-in weights, after the modeled stall of copying the real ones out (relay mode)."""
        import torch  # late: torch; configs validate without it
        time.sleep(self.stall_s / self.s.speedup)
        self.sim_busy_s += self.stall_s
        return {"model": {"sim.weights": torch.zeros(max(1, self.s.weight_bytes // 4), dtype=torch.float32)}}


class ModeledDelivery:
    """Writes each version into every host's weight folder at its modeled arrival time and
    announces it on `weights.version` through `publish` (as that host's relay would). Runs on
    the trainer role's event loop."""

    def __init__(self, publish: Callable[[str, Any], None], stopping: asyncio.Event, settings: SimTrainerSettings,
                 cost: TrainerCost, loop: asyncio.AbstractEventLoop):
        self.publish, self.stopping, self.s, self.loop = publish, stopping, settings, loop
        link = cost.link
        at_once = settings.nccl is not None or settings.colocated  # every host has it when it begins
        hop = 0.0 if at_once else link.chunk_mib * 2 ** 20 / link.bytes_per_s + link.alpha_s
        # host i has it S/B after the stall began, plus (i - 1) hops behind the master (i >= 1)
        self.offsets = [max(0, i - 1) * hop for i in range(len(settings.deliver or []))]
        self.stores: dict[str, Any] = {}
        self.handles: set[asyncio.TimerHandle] = set()
        self.delivered: dict[str, int] = {}

    def from_thread(self, version: int) -> None:
        self.loop.call_soon_threadsafe(self.schedule, version)

    def schedule(self, version: int) -> None:
        """Called when the stall ends (the master relay holds the version)."""
        for target, off in zip(self.s.deliver or [], self.offsets, strict=False):
            if off <= 0:
                self.deliver(target, version)
                continue
            h = self.loop.call_later(off / self.s.speedup, self._fire, target, version)
            self.handles.add(h)

    def _fire(self, target: DeliverTarget, version: int) -> None:
        self.handles = {h for h in self.handles if not h.cancelled() and h.when() > self.loop.time()}
        if not self.stopping.is_set():
            self.deliver(target, version)

    def deliver(self, target: DeliverTarget, version: int) -> None:
        if self.delivered.get(target.host, -1) >= version:
            return  # a later version got there first (never go backwards)
        write_stand_in(self._store(target.dir), version, self.s.weight_bytes)
        self.delivered[target.host] = version
        self.publish(f"weights.version.sim-{target.host}", WeightsVersion(f"sim-{target.host}", target.host, version,
                                                       self.s.weight_bytes, target.dir))

    def _store(self, directory: str):
        st = self.stores.get(directory)
        if st is None:
            st = self.stores[directory] = ShmStore(directory)
            st.open()
        return st

    def close(self) -> None:
        for h in self.handles:
            h.cancel()
        self.handles.clear()
        for st in self.stores.values():
            st.close()
            st.remove_files()
        self.stores.clear()


def write_stand_in(store, version: int, nbytes: int) -> None:
    """Commit a `nbytes` stand-in version into a ShmStore exactly as a relay commits a received
    one (double buffer, checksummed and sealed chunks, atomic pointer), with numpy instead of torch."""
    m = build_manifest([("sim.weights", "float32", (max(1, nbytes // 4),))], version, 1 << 20)
    vb = begin_local(store, m)
    if vb is None:
        return  # the store already holds this version or a newer one
    payload = np.full(max(1, nbytes // 4), float(version), dtype=np.float32).view(np.uint8)
    vb.view[: payload.size] = payload.tobytes()
    commit_local(store, vb)


def old_logprob_passes(settings) -> int:
    """Forward passes the trainer's settings add to an iteration: the old (proximal) policy's
    logprobs recomputed (`old_logprobs: recompute`, or an off-policy correction), as the real
    engine does for those settings: one pass."""
    return int(settings.loss.old_logprobs == "recompute" or settings.loss.off_policy != "none")
