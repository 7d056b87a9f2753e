"""TrainerRole: GRPO (or PPO) on whole groups from the experience buffer; one version per global batch.

    setup: seed, join the other ranks (distributed.world_size > 1), load the model (+ reference, + critic) and
           optimizers (TrainEngine); resume from the newest complete checkpoint (model, optimizer,
           RNGs, version, buffer cursor); rank 0 connects to the experience buffer and starts the
           WeightPublisher towards the master relay. Each SampleGroups carries our cursor and the
           newest checkpoint's (`committed`): the buffer keeps what it handed us since that
           checkpoint and, after a resume, hands it again in the same order
    loop:  SampleGroups until groups_per_batch whole groups are held (a short buffer is asked
           again after sample_wait_s; with loss.filter_groups, dynamic sampling: the buffer drops groups
           without a spread, up to max_dropped a version, and the version's metrics count them)
           -> `step_started` -> minibatch_steps optimizer steps (in a
           worker thread, so the loop keeps heartbeating) -> version += 1 -> publish (only the
           copy into staging is waited for: `published` logs that stall) -> metrics -> every
           checkpoint.every versions an atomic checkpoint -> next iteration at once. With
           checkpoint.export_dir, the version that reaches max_iterations is also written there as
           a Hugging Face folder.
           With checkpoint.keep_best, rank 0 follows the evaluator's results and keeps the
           checkpoint of the best-scoring version in best/ (best.py).
Ranks > 0 have no loop of their own: they follow rank 0's command stream (dist.py) and join each
collective. The relay tier's progress is watched by a thread that logs `publish_delivered` when
the master holds a version, so the logs show the next `step_started` before the previous
version's delivery. Every event also goes to `self.events` (in order), which in-process tests read.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

from laminar.bus.errors import RpcError
from laminar.roles.trainer import checkpoint, dist
from laminar.roles.trainer.best import BestCheckpoint
from laminar.roles.trainer.config import TrainerConfig
from laminar.roles.trainer.memory import rss_bytes, trim_heap
from laminar.roles.trainer.metrics import MetricsLog, batch_stats, trained_members, trained_weights
from laminar.roles.trainer.publishing import PublishLink

from laminar.protocol import BufferStatsRequest, Metrics, SampleGroups, Samples
from laminar.role_base import Role
from laminar.samples import SampleLog, trained_rows
from laminar.threads import work_thread


def in_thread(fn, name: str) -> asyncio.Future:
    """Run blocking torch work in a daemon thread: a follower blocked in a collective must not
    keep its process alive after stop (the default executor's threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def work() -> None:
        try:
            res = fn()
            done = lambda: fut.done() or fut.set_result(res)  # noqa: E731
        except BaseException as exc:  # noqa: BLE001  (handed to the awaiting coroutine)
            done = lambda e=exc: fut.done() or fut.set_exception(e)  # noqa: E731
        try:
            loop.call_soon_threadsafe(done)
        except RuntimeError:
            pass  # the loop is closed: the role has stopped and nobody awaits this result
    work_thread(work, name)
    return fut


class TrainerRole(Role):
    """One trainer rank: samples batches from the buffer, steps the policy, publishes each version."""
    name = "trainer"
    Config = TrainerConfig

    def __init__(self, ctx):
        super().__init__(ctx)
        self.version = 0
        self.cursor = 0        # groups received from the experience buffer (its hand-out position)
        self.committed = None  # the cursor of the newest checkpoint (None: no checkpoints, hand-outs final)
        self.state = "starting"
        self.events: list[tuple[str, dict]] = []
        self.link: PublishLink | None = None
        self.info = dist.DistInfo()
        self.resumed_from = None
        self._iter: asyncio.Future | None = None
        self._stop_sent = False
        self.best: BestCheckpoint | None = None  # checkpoint.keep_best's keeper (rank 0)

    # -- helpers --------------------------------------------------------------------------
    def workdir(self) -> Path:
        base = self.cluster.workdir() if self.cluster is not None else Path("runs/run")
        return base / ("trainer" if self.ctx.id == "0" else f"trainer-{self.ctx.id}")

    def event(self, name: str, **fields) -> None:
        self.events.append((name, fields))
        self.log.info(name, **fields)

    @property
    def main(self) -> bool:
        return self.info.is_main

    @property
    def publisher(self):
        return self.link.publisher if self.link is not None else None

    def _rank_and_address(self) -> tuple[int, str]:
        c, cluster = self.settings, self.cluster
        rank = c.distributed.rank if c.distributed.rank is not None else int(self.ctx.id)
        if not 0 <= rank < c.distributed.world_size:
            raise ValueError(f"trainer.{self.ctx.id}: rank {rank} is not in 0..{c.distributed.world_size - 1}")
        if c.distributed.address:
            return rank, c.distributed.address
        host, _ = cluster.spec("trainer", "0")
        return rank, f"{cluster.cluster.hosts[host].address}:{c.distributed.port}"

    # -- setup ----------------------------------------------------------------------------
    async def setup(self) -> None:
        c = self.settings
        self.dir = self.workdir()
        self.metrics = None
        self.ckpt_root = Path(c.checkpoint.dir) if c.checkpoint.dir else self.dir / "checkpoints"
        if c.engine == "sim":  # the scale simulator's trainer: no torch, no model, no checkpoint (sim_engine.py)
            from laminar.roles.trainer.sim_engine import SimTrainEngine  # late: only for engine: sim
            self.engine = SimTrainEngine.from_trainer_config(c, self.pub.publish, self.stopping)
            self.device = "sim"
            self.log.info("sim_trainer", **self.engine.describe())
        else:
            await in_thread(self._load, "trainer-load")
        if not self.main:
            self.state = "ready"
            self.event("trainer_ready", rank=self.info.rank, version=self.version, device=str(self.device))
            if self._publish_gathers():  # rank 0 publishes its start version (0, or the checkpoint's)
                self.link = PublishLink.follower(self)  # copies this rank's shards (sharded_publish.py)
                await in_thread(lambda: self.link.publish_engine(self.engine, self.version), "trainer-publish")
            return
        self.metrics = MetricsLog(self.dir)  # rank 0 alone writes metrics and checkpoints
        # groups handed out after our checkpoint stay leased in the buffer until the next one, so
        # a trainer killed in between gets them again on resume (trained exactly once in what it keeps)
        self.committed = self.cursor if c.engine != "sim" else None
        self.metrics.truncate_after(self.version)
        if c.logging.tensorboard:
            self.metrics.open_tensorboard()
        self.best = self._best_keeper()
        self.buffer = self.ctx.transport.client(self.cluster.endpoint("experience_buffer", c.experience_buffer))
        if self.resumed_from is not None:
            lost = None
            try:
                st = await self.buffer.call(BufferStatsRequest(), timeout=5.0)
                lost = st.counts.get("handed_out", self.cursor) - self.cursor
            except RpcError:
                pass
            self.event("resumed", version=self.version, checkpoint=str(self.resumed_from), cursor=self.cursor,
                       groups_handed_out_since=lost)
        if c.publishing.enabled:
            # Every start or resume is a new lineage (recorded next to the checkpoints first), and
            # its weights go out at once: version 0 of a new run, or the checkpoint's version,
            # which relays and rollouts take even over a higher number of the discarded lineage.
            from laminar.weights.lineage import advance_lineage
            self.run_id, self.lineage = advance_lineage(self.ckpt_root, self.version)
            from laminar.weights.lineage import read_lineage  # late: only on a resume
            self.forks = (read_lineage(self.ckpt_root) or {}).get("forks", {})
            self.link = PublishLink(self, c)
            await self.link.start()
            self.link.publisher.run_id, self.link.publisher.lineage = self.run_id, self.lineage
            self.event("lineage", lineage=self.lineage, run_id=self.run_id, version=self.version)
            await self._publish()
        self.state = "ready"
        self.event("trainer_ready", version=self.version, device=str(self.device), model=c.model_dir,
                   params=self.engine.params, world_size=c.distributed.world_size)

    def _load(self) -> None:
        import random  # late: this block is the real trainer's (torch, the engine); engine: sim has none

        import numpy as np
        import torch
        from laminar.roles.trainer.engine import TrainEngine

        from laminar.models.loading import pick_device
        c = self.settings
        seed = c.seed if c.seed is not None else (self.cluster.run.seed if self.cluster else 0)
        rank, address = self._rank_and_address() if c.distributed.world_size > 1 else (0, "")
        torch.manual_seed(seed + rank)
        np.random.seed(seed + rank)
        random.seed(seed + rank)
        self.device = pick_device(c.device)
        if self.device.type == "cuda" and c.distributed.world_size > 1:
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
        self.info = dist.init(rank, c.distributed.world_size, address, self.device, c.distributed.timeout_s)
        self.engine = TrainEngine(c, seed, self.device, self.info)
        self.engine.load()
        parts, kind = None, 0  # the checkpoint: 0 none, 1 full state dicts, 2 sharded (any number of ranks)
        if self.main:
            checkpoint.clean_temp(self.ckpt_root)
            self.resumed_from = checkpoint.latest(self.ckpt_root) if c.checkpoint.resume else None
            if self.resumed_from is not None:
                st = checkpoint.read_state(self.resumed_from)
                kind = 2 if checkpoint.is_sharded(st) else 1
                if kind == 1:
                    parts, st = checkpoint.load(self.resumed_from, map_location="cpu")
                self.version, self.cursor = int(st["version"]), int(st["cursor"])
        self.version, self.cursor, resumed = dist.broadcast_ints(self.info, [self.version, self.cursor, kind])
        if resumed == 2:  # every rank reads its own shards of rank 0's checkpoint
            path = dist.broadcast_bytes(self.info, str(self.resumed_from).encode() if self.main else None)
            self.engine.restore_sharded(path.decode())
        elif resumed:
            self.engine.restore(parts)
        if resumed:
            if self.main:
                checkpoint.load_rng(self.resumed_from)
            else:
                self.resumed_from = "rank 0's checkpoint"

    async def _deliver_last(self) -> None:
        """The last version reaches the master relay before the trainer leaves (publishing.py)."""
        if self.link is None or not self.settings.publishing.enabled:
            return
        t0 = time.monotonic()
        try:
            got = await self.link.deliver_last(self.version)
        except Exception as e:  # its overlapped copy or commit failed: say so (the checkpoint has it)
            self.log.error("final_version_not_published", version=self.version, error=repr(e),
                           why="its copy into the staging or its commit failed; the checkpoint has it")
            return
        if got:
            self.event("final_version_delivered", version=self.version, wait_s=round(time.monotonic() - t0, 3))
        elif got is not None:
            self.log.warning("final_version_not_delivered", version=self.version,
                             waited_s=round(time.monotonic() - t0, 1),
                             why="the master relay did not take it in time; the checkpoint has it")

    def _publish_gathers(self) -> bool:
        """Whether each publish is a collective (every rank copies its shards: sharded_publish.py)."""
        return self.settings.publishing.enabled and self.info.enabled

    # -- main loop --------------------------------------------------------------------------
    async def run(self) -> None:
        self.state = "training"
        if not self.main:
            return await self._follow()
        while not self.stopping.is_set():
            if self.settings.max_iterations is not None and self.version >= self.settings.max_iterations:
                await self._deliver_last()
                self.event("training_finished", version=self.version)
                return
            groups = await self._collect()
            if groups is None:
                return
            # shielded: a stop in the middle lets the iteration (and its collectives) finish
            self._iter = asyncio.ensure_future(self._iteration(groups))
            await asyncio.shield(self._iter)

    async def _collect(self):
        need, groups, warned = self.settings.groups_per_batch, [], 0.0
        f = self.settings.loss.filter_groups
        cap = (f.max_dropped if f.max_dropped is not None else 3 * need) if f is not None else 0
        self.intake = {"groups_dropped_nosignal": 0, "nosignal_tokens": 0, "filter_cap_reached": 0}
        while len(groups) < need:
            if self.stopping.is_set():
                return None
            left = cap - self.intake["groups_dropped_nosignal"]
            try:
                s = await self.buffer.call(SampleGroups(need - len(groups), self.version, cursor=self.cursor,
                                                        committed=self.committed, lineage=getattr(self, "lineage", -1),
                                                        forks=getattr(self, "forks", {}),
                                                        run_id=getattr(self, "run_id", ""),
                                                        filter_metric=f.metric if f is not None and left > 0 else "",
                                                        filter_min_std=f.min_std if f is not None else 0.0,
                                                        filter_max_drop=max(left, 0)), timeout=30.0)
            except RpcError as exc:
                if time.monotonic() - warned > 10:
                    self.log.warning("buffer_unavailable", error=str(exc))
                    warned = time.monotonic()
                await asyncio.sleep(max(self.settings.performance.sample_wait_s, 0.5))
                continue
            groups += s.groups
            self.cursor = s.cursor
            self.intake["groups_dropped_nosignal"] += s.dropped_nosignal
            self.intake["nosignal_tokens"] += s.dropped_nosignal_tokens
            if f is not None and s.dropped_nosignal and self.intake["groups_dropped_nosignal"] >= cap:
                self.intake["filter_cap_reached"] = 1
                self.log.warning("filter_cap_reached", version=self.version + 1, dropped=cap, kept=len(groups),
                                 why="this version dropped max_dropped groups for no signal: it trains on what "
                                     "the buffer hands out next, informative or not")
            if len(groups) < need:
                await asyncio.sleep(self.settings.performance.sample_wait_s)
        return groups

    async def _publish(self) -> float:
        t0 = time.perf_counter()
        await in_thread(lambda: self.link.publish_engine(self.engine, self.version), "trainer-publish")
        self.link.last_stall_s = stall = time.perf_counter() - t0
        self.event("published", version=self.version, stall_s=round(stall, 6))
        return stall

    def _train(self, groups):
        if self.info.enabled:
            dist.send_command(self.info, dist.OP_TRAIN, self.version, self.cursor, Samples(groups, self.cursor))
        return {**self.engine.train(groups, self.version + 1), **self._trim()}

    def _trim(self) -> dict:
        """After a step: the step's freed activations back to the kernel (memory.trim_heap), on the CPU."""
        if not self.settings.performance.trim_heap or str(getattr(self.engine, "device", "cpu")) != "cpu":
            return {}
        freed = trim_heap()
        return {} if freed is None else {"heap_trimmed_bytes": float(freed)}

    async def _iteration(self, groups) -> None:
        self.event("step_started", version=self.version + 1, groups=len(groups))
        stats = batch_stats(groups, self.version, getattr(self, "lineage", -1), getattr(self, "forks", {}))
        t0 = time.perf_counter()
        train = await in_thread(lambda: self._train(groups), "trainer-train")
        train_s = time.perf_counter() - t0
        self.version += 1
        stall = await self._publish() if self.link is not None else 0.0
        intake = getattr(self, "intake", {})
        dropped = intake.get("groups_dropped_nosignal", 0)
        values = {**stats, **train, **{k: float(v) for k, v in intake.items()},
                  "groups_generated": float(len(groups) + dropped),
                  "groups_kept": float(len(groups) - train.get("groups_uniform", 0.0)),
                  "train_s": train_s, "tokens_per_s": train["tokens"] / max(train_s, 1e-9),
                  "publish_stall_s": stall, "version": float(self.version), "cursor": float(self.cursor),
                  "rss_bytes": float(rss_bytes())}   # rank 0's resident set: a growth shows before the OOM killer
        record = {**values, "ts": time.time(), "group_ids": [g[0].spec.group_id for g in groups],
                  "weights": trained_weights(groups)}
        if self.settings.logging.record_members:
            record["members"] = trained_members(groups)
        self.metrics.append(record)
        self.pub.publish("metrics.trainer", Metrics(role="trainer", id=self.ctx.id, ts=time.time(), values=values))
        every = self.settings.logging.samples_every
        if every and self.version % every == 0 and self.settings.engine != "sim":
            rows = trained_rows(groups, self.version - 1, self.settings.logging.samples)
            await asyncio.to_thread(self._sample_log().write, "trainer", self.version, rows)
        self.event("iteration", version=self.version, reward_mean=round(stats["reward_mean"], 4),
                   loss=round(train.get("loss", 0.0), 6), tokens_per_s=round(values["tokens_per_s"], 1),
                   publish_stall_s=round(stall, 6))
        if self.version % self.settings.checkpoint.every == 0 and self.settings.engine != "sim":  # sim: no state
            path = await in_thread(self._checkpoint, "trainer-checkpoint")
            self.committed = self.cursor  # the buffer may forget the groups before it (next request)
            self.event("checkpoint_saved", version=self.version, path=str(path), cursor=self.cursor)
            if self.best is not None:
                await self._judge(self.best.saved, self.version, self.version)
        if self._exports_now(self.version):
            path = await in_thread(self._export, "trainer-export")
            self.event("exported", version=self.version, path=str(path))

    def _best_keeper(self) -> BestCheckpoint | None:
        """With checkpoint.keep_best: the keeper, and a task following the evaluator's results."""
        c, cluster = self.settings, self.cluster
        if not c.checkpoint.keep_best or c.engine == "sim":
            return None
        evaluators = [s.id for _, s in cluster.find("evaluator")] if cluster is not None else []
        metric = cluster.settings_of("evaluator", evaluators[0]).best_metric if evaluators else None
        if metric is None:
            self.log.warning("best_checkpoint_off", why="keep_best_checkpoint needs an evaluator with best_metric")
            return None
        keeper = BestCheckpoint(self.dir, self.ckpt_root, metric, c.checkpoint.every)
        self.eval_sub = self.ctx.transport.subscriber(["metrics.evaluator"])
        self.spawn(self._follow_evaluations(keeper), "best-checkpoint")
        return keeper

    async def _follow_evaluations(self, keeper: BestCheckpoint) -> None:
        try:
            while True:
                _, ev = await self.eval_sub.recv()
                if isinstance(ev, Metrics) and isinstance(ev.values, dict):
                    await self._judge(keeper.heard, ev.values, ev.values.get("version"))
        finally:
            self.eval_sub.close()

    async def _judge(self, how, arg, version) -> None:
        """Run one of the keeper's judgements of `version` off the loop (it may copy a checkpoint)
        and log what came of it."""
        try:
            got = await asyncio.to_thread(how, arg)
        except OSError as exc:  # rotation removed the folder while it was copied: the next best will do
            self.log.warning("best_checkpoint_failed", version=version, error=repr(exc))
            return
        if got == "kept":
            self.event("best_checkpoint_kept", version=self.best.best["version"], value=self.best.best["value"])
        elif got == "no_checkpoint":
            self.event("best_checkpoint_no_checkpoint", version=None if version is None else int(version))

    def _sample_log(self) -> SampleLog:
        if getattr(self, "sample_log", None) is None:
            self.sample_log = SampleLog(self.dir.parent / "samples.jsonl", self.settings.model_dir)
        return self.sample_log

    def _exports_now(self, version: int) -> bool:
        """Whether `version` is the run's final one and goes to `export_dir` (a collective on every rank)."""
        c = self.settings
        return c.checkpoint.export_dir is not None and c.engine != "sim" and version == c.max_iterations

    def _export(self):
        """The final weights as a Hugging Face folder in export_dir (laminar/export.py)."""
        # late: torch and transformers, only at the end with export_dir
        from laminar.export import write_adapter, write_folder
        parts = self.engine.full_state()
        if not self.main:
            return None
        adapter = self.engine.manifest_fields().get("adapter_config")
        out, model_dir = self.settings.checkpoint.export_dir, self.settings.model_dir
        if adapter:  # LoRA: the adapter in peft's format (`laminar-node export --merge` merges it)
            return write_adapter({k: v.detach() for k, v in parts["model"].items()}, adapter, out, model_dir,
                                 self.version, f"trainer {self.ctx.id}")
        return write_folder({k: v.detach() for k, v in parts["model"].items()}, out, model_dir,
                            got_version=self.version, source=f"trainer {self.ctx.id}")

    def _checkpoint(self):
        if self.info.enabled:  # every rank writes its own shards (DCP): nothing is gathered
            return self.engine.save_sharded(self.ckpt_root, self.version, {"cursor": self.cursor},
                                            self.settings.checkpoint.keep)
        parts = self.engine.full_state(with_optimizer=True)
        if not self.main:
            return None
        # a LoRA adapter's config and base identity, for `laminar-node export` (laminar/export.py)
        fields = {k: v for k, v in self.engine.manifest_fields().items() if k != "content"}
        return checkpoint.save(self.ckpt_root, self.version, parts, {"cursor": self.cursor, **fields},
                               self.settings.checkpoint.keep)

    # -- ranks > 0 ------------------------------------------------------------------------------
    async def _follow(self) -> None:
        while True:
            op, version, cursor, samples = await in_thread(lambda: dist.recv_command(self.info), "trainer-follow")
            if op == dist.OP_STOP:
                self._stop_sent = True  # rank 0 sent it: both leave the process group in stop()
                self.event("training_finished", version=self.version)
                return
            self.event("step_started", version=version + 1, groups=len(samples.groups))
            await in_thread(lambda s=samples, v=version: self._follow_iteration(s.groups, v), "trainer-train")
            self.version, self.cursor = version + 1, cursor
            self.event("iteration", version=self.version)

    def _follow_iteration(self, groups, version: int) -> None:
        self.engine.train(groups, version + 1)
        self._trim()
        if self._publish_gathers():
            self.link.publish_engine(self.engine, version + 1)
        if (version + 1) % self.settings.checkpoint.every == 0:
            self.engine.save_sharded(None, version + 1, {}, self.settings.checkpoint.keep)
        if self._exports_now(version + 1):
            self.engine.full_state()

    # -- lifecycle ----------------------------------------------------------------------------
    async def stop(self) -> None:
        await super().stop()
        if self.main and self.info.enabled and not self._stop_sent:
            if self._iter is not None and not self._iter.done():
                await asyncio.gather(self._iter, return_exceptions=True)
            self._stop_sent = True
            await in_thread(lambda: dist.send_command(self.info, dist.OP_STOP, self.version), "trainer-stop")
        if self.link is not None:
            await self.link.close()
        if self.info.enabled and self._stop_sent:  # every rank passed the stop command: leave together
            try:
                await asyncio.wait_for(in_thread(lambda: dist.shutdown(self.info), "trainer-dist-shutdown"), 10.0)
                self.log.info("dist_left", rank=self.info.rank)
            except TimeoutError:
                self.log.warning("dist_shutdown_timeout", rank=self.info.rank)
        if getattr(self, "metrics", None) is not None:  # None on ranks > 0 and before setup
            self.metrics.close()

    def status(self) -> dict:
        # run_id: the trainer's word on its run, which relays and rollouts pin to (docs/weights.md)
        return {"version": self.version, "lineage": getattr(self, "lineage", 0), "run_id": getattr(self, "run_id", ""),
                "state": self.state,
                "cursor": self.cursor, "rank": self.info.rank,
                "publish_stall_s": round(self.link.last_stall_s, 6) if self.link else 0.0,
                "delivered": self.publisher.delivered if self.publisher is not None else None}
