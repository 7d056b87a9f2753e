"""RolloutRole: the batch lifecycle of one inference replica (docs/architecture.md §5; repack's execution: §7).

    loop:  [pull newest weights if newer] -> TakeBatch -> generate all of it with ONE version
           -> each finished trajectory: score -> PutTrajectory (durable) -> CompletePartial
           -> batch done (or emptied by a repack) -> loop
           (early intake: once nothing generates, the next batch of the same version starts while
           the last ones are still stored; a newer version waiting on the relay drains it first)
    modes: TakeBatch carries this rollout's version, so the prompt pool's barrier gate (sync,
           one_step, stream) holds it back until the trainer's next version; `weights.version`
           events wake an idle rollout at once. `refill` (stream mode's default) takes new
           groups of the same version as trajectories finish instead of at batch end; without a
           gate (laminar modes) only until this host's relay holds a newer version and a batch's
           worth (max_concurrency) was taken on this one, then what runs drains and the loop
           loads the newest.

The role wires its components in setup() and keeps the batch loop and its intake policy:
    work.py       Work: the active trajectories, the lock and the loop's wake-up events (shared)
    weights.py    WeightFollower: the weights the engine holds, loads from the relay, what it holds
    batch_seq.py  BatchSeq: TakeBatch numbers reserved on disk, never reused across restarts
    runner.py     TrajectoryRunner: per trajectory: generate (or an episode: multiturn.py, agent.py), score, store
    streaming.py  DeltaStream: token deltas to the partial pool, paged; fenced-off work dropped
    group_commit.py  GroupCommit: callers at once share one request (make_durable, CompletePartial)
    migration.py  Migration: MigrateOut, MigrateIn, adoption of an older version's work
    routing.py    RoutingPuller: a MoE policy's routing rows from the engine into each trajectory
                  (roles.rollout.moe.routing; used by streaming, runner and multiturn)

Tasks: `loop` (run), `gen:<id>`/`finish:<id>` (one per trajectory), `flush` (every
delta_interval_s), `report` (rollout.stats every report_interval_s), `versions` (weights.version
events), and the control server's MigrateOut/MigrateIn handlers; in agent mode `announce` and
`call:<id>` (one per agent call) and the AgentCall/EndEpisode handlers. They share one event loop, so
nothing interleaves between two awaits; work.lock spans the awaits where it matters. Who writes
what, and how the others ask:

  work.active          the loop (new work) and MigrateIn (migrants), both under work.lock; removed
                       by the trajectory's own finish task (stored), by flush (fenced off) and by
                       MigrateOut (handed over), all through work.left(). A removal sets
                       room_freed (a hand-over only when it was the last), the last batch_done:
                       that is how the loop learns of it.
  work.generating      added with work.active; removed when the trajectory's generation ends (its
                       task, before scoring) or it leaves; the last removal sets gen_done (the
                       loop's early intake).
  weights.version,     the loop alone (weights.update; run_adopted -> weights.load_retained), under
    .lineage, .run_id  work.lock with nothing active (and setup's first load, before any task).
                       MigrateIn reads them under the lock: no load slips between check and start.
  weights.newest_here  the `versions` task (events), `report` and the loop before an early intake
                       (the relay's pointer); the loop's intake policy reads it (_draining_for_newer).
  migration.adopted    appended by MigrateIn(adopt) under the lock, which then sets work.wake to
                       wake an idle loop; emptied by the loop (run_adopted).
  migration.pinned     set by run_adopted; cleared by the loop once nothing is active.
  taken_on_version,    the loop alone.
    batches, seqs
  work.state           the loop, weight loads and MigrateIn (a label, only reported).
  agents.open          agent mode (agent.py): an episode is added by its trajectory's task and removed
                       by it (moved away) or by the runner once stored (release); its Active's
                       `hold` is cleared, and `busy` set and cleared, only by the episode's own call
                       task, which is the only writer of its tokens until it ends.
  counters             each by its component: work.generated (trajectory tasks),
                       weights.pull_failures, runner.puts_refused and gave_up, stream.fenced_off;
  Active.routing       appended only, by the RoutingPuller (flush, a turn's or a trajectory's end);
                       the rows past those held, so concurrent pulls add each row once.
                       take_failures (the loop).

Writes that must arrive (deltas, trajectories) are retried until acknowledged; all of them are
idempotent. A failed weight load keeps the loaded weights (weights.py).
"""
from __future__ import annotations

import asyncio
import os
import time

from laminar.bus.errors import RemoteError
from laminar.bus.retry import call_acked
from laminar.roles.rollout.agent import AgentEpisodes
from laminar.roles.rollout.batch_seq import BatchSeq
from laminar.roles.rollout.config import RolloutConfig
from laminar.roles.rollout.engine_api import build_rollout_engine
from laminar.roles.rollout.migration import Migration
from laminar.roles.rollout.multiturn import EpisodeRunner
from laminar.roles.rollout.rewards import RewardPlan
from laminar.roles.rollout.routing import RoutingPuller
from laminar.roles.rollout.runner import TrajectoryRunner
from laminar.roles.rollout.streaming import DeltaStream
from laminar.roles.rollout.trajectory import Active
from laminar.roles.rollout.weights import WeightFollower
from laminar.roles.rollout.work import Work

from laminar.engine_settings import engine_seqs
from laminar.protocol import AgentCall, EndEpisode, MigrateIn, MigrateOut, RolloutStats, TakeBatch
from laminar.role_base import Role
from laminar.weights.seal import arm_engine_checks


class RolloutRole(Role):
    """One inference replica: takes batches, generates them on one weight version, stores them."""

    name = "rollout"
    Config = RolloutConfig

    def __init__(self, ctx):
        super().__init__(ctx)
        self.work = Work()
        self.batches = 0
        self.take_failures = 0  # TakeBatch answered `internal` past call_acked's bound (then idle_wait_s)
        self.taken_on_version = 0  # new trajectories taken since nothing last ran (weights change only then)
        self._group_size = 1
        self._addresses: dict[tuple[str, str], str] = {}  # (role, id) -> address, looked up once
        self._gen_at_last_report = 0
        self._took = False  # the last turn of the loop started new trajectories (early intake waits on them)
        self._gated = False  # the last TakeBatch came back empty at the prompt pool's gate (Batch.gated)
        # set in setup() (wire): the engine and the components around it, the pools' clients, the
        # control server, the `weights.version` subscription (None until then: stop() after a failed
        # setup works)
        self.engine = self.episodes = self.seqs = self.weights = self.stream = self.runner = self.migration = None
        self.agents = None  # agent mode (roles/rollout/agent.py)
        self.prompts = self.partials = self.buffer = None
        self.server = self.versions_sub = None

    @property
    def active(self) -> dict[str, Active]:
        """The trajectories in flight here (Work.active)."""
        return self.work.active

    @property
    def version(self) -> int:
        """The weight version the engine holds (WeightFollower.version)."""
        return self.weights.version

    @property
    def refill(self) -> bool:
        """Take new groups as trajectories finish (stream mode's default) rather than at batch end."""
        if self.settings.refill is not None:
            return self.settings.refill
        return self.cluster is not None and self.cluster.run.mode == "stream"

    @property
    def gated(self) -> bool:
        """A barrier mode: the prompt pool's gate, not this rollout, ends a version's work."""
        return self.cluster is not None and self.cluster.run.barrier_lag is not None

    def _draining_for_newer(self) -> bool:
        """Refill without a gate stops once this host's relay holds weights that replace ours and
        this version has had a batch's worth of new work (max_concurrency trajectories): what runs
        finishes on its version, then the loop loads the new one. Without the stop the batch would
        never drain and the rollout would keep its first weights for the whole run; without the
        batch's worth it would drain at every version, and a drain (the engine emptying through
        its longest response) costs the same whether it follows 50 trajectories or 5,000."""
        return (not self.gated and self.weights.newer_waiting()
                and self.taken_on_version >= self.settings.max_concurrency)

    # -- setup ------------------------------------------------------------------------------
    def _address(self, role: str, id: str) -> str:
        """role.id's request/reply address, looked up once (the config is fixed for the process;
        every report carries this rollout's own, and a lookup scans every placement)."""
        key = (role, id)
        if (got := self._addresses.get(key)) is None:
            got = self._addresses[key] = self.cluster.endpoint(role, id)
        return got

    async def setup(self) -> None:
        settings, cluster, t = self.settings, self.cluster, self.ctx.transport
        reward = RewardPlan.from_settings(settings.reward, settings.rewards)
        prompts = t.client(self._address("prompt_pool", settings.prompt_pool))
        partials = t.client(self._address("partial_pool", settings.partial_pool))
        buffer = t.client(self._address("experience_buffer", settings.experience_buffer))
        shm_dir = settings.shm_dir
        if settings.relay_id is not None and shm_dir is None:  # the relay's own folder
            shm_dir = cluster.relay_shm_dir(settings.relay_id)
        keys = getattr(t, "keys", None)
        if settings.relay_id is not None and settings.engine == "vllm":
            arm_engine_checks(keys)  # its worker processes check each version's seals before loading
        self.engine = self._make_engine()
        await self.engine.start()
        self.wire(self.engine, prompts=prompts, partials=partials, buffer=buffer, reward=reward,
                  shm_dir=shm_dir, seq_file=cluster.workdir() / f"rollout-{self.ctx.id}" / "batch_seq.json")
        await asyncio.to_thread(self.seqs.start)
        if settings.env is not None:
            env = settings.env
            self.episodes = self.runner.episodes = EpisodeRunner.build(  # the role starts and stops it
                env, self.engine, t, self._address("env", env.role_id) if env.role_id is not None else None,
                self.ctx.id, seed=settings.seed, make_durable=self.stream.make_durable, log=self.log,
                on_tokens=self.work.count)
            await self.episodes.start()
        if settings.agent is not None:
            self.agents = self.runner.agents = AgentEpisodes(
                settings.agent, settings.model_dir, self.engine, self.ctx.id, self._address("rollout", self.ctx.id),
                t.client(self._address("gateway", settings.agent.gateway)), self.stream.make_durable, self.spawn,
                self.log, max_model_len=settings.max_model_len, seed=settings.seed, on_tokens=self.work.count)
        await self.weights.update()
        self.server = t.server(cluster.bind_endpoint("rollout", self.ctx.id), "rollout", self.ctx.id)
        self.server.route(MigrateOut, self.migration.on_migrate_out)
        self.server.route(MigrateIn, self.migration.on_migrate_in)
        if self.agents is not None:
            self.server.route(AgentCall, self.agents.on_call)
            self.server.route(EndEpisode, self.agents.on_end)
        await self.server.start()
        # the trainer's heartbeat names its run; the prompt pool's gate_open wakes an idle loop
        self.versions_sub = t.subscriber(["weights.version", "hb.trainer.", "data.gate_open"])
        self.log.info("rollout_ready", version=self.version, model=settings.model_dir, address=self.server.address)

    def wire(self, engine, *, prompts=None, partials=None, buffer=None, reward=None, shm_dir=None,
             seq_file=None) -> None:
        """Build the components around a started engine and the pools' clients (setup; unit tests
        wire stubs). Each gets what it needs passed in; none of them knows the role."""
        s, rid, log = self.settings, self.ctx.id, self.log
        self.engine, self.prompts, self.partials, self.buffer = engine, prompts, partials, buffer
        self.seqs = BatchSeq(seq_file, log)
        self.weights = WeightFollower(engine, shm_dir, self.ctx.host, self.work, log, s.pull_retry_s, s.relay_id)
        routing = RoutingPuller(engine, log) if s.moe.routing else None
        self.stream = DeltaStream(rid, self.work, partials, s.rpc_timeout_s, log, routing=routing)
        self.runner = TrajectoryRunner(rid, s, self.work, self.weights, engine, self.episodes, reward, buffer,
                                       partials, self.spawn, log)
        self.runner.routing = routing
        if self.episodes is not None:
            self.episodes.routing = routing
        self.migration = Migration(rid, self.work, self.weights, self.stream, partials, self.runner.start,
                                   self._call, s.max_concurrency, log)
        self.runner.give_up = self.migration.give_up

    def _make_engine(self):
        cores = None
        if self.settings.engine == "vllm":  # its OpenMP threads on the rollout's cores
            _, spec = self.cluster.spec("rollout", self.ctx.id)
            cores = spec.cores
        return build_rollout_engine(self.settings, cores)

    async def _call(self, client, req):
        """Until answered (the bus's call_acked): TakeBatch here, the partial pool's calls in Migration."""
        return await call_acked(client, req, self.settings.rpc_timeout_s, self.log)

    # -- main loop --------------------------------------------------------------------------
    # Each turn of the loop is one decision, taken under the lock (no weight load or MigrateIn
    # slips in): settle which weights the engine runs, take as many new trajectories as there is
    # room for, then do what the outcome says:
    #
    #   AGAIN       decide again at once (e.g. nothing active and nothing taken this turn)
    #   IDLE        nothing to run: wait for a wake (new version, adopted work, gate opened), a stop, or
    #               idle_wait_s (at the pool's gate shut for this version: _wait_at_gate)
    #   GENERATING  trajectories run: wait for room (refill) or for the batch to end (_await_room)
    #   EXHAUSTED   the prompt pool has no more epochs and nothing runs here: finish (exit 0)
    AGAIN, IDLE, GENERATING, EXHAUSTED = "again", "idle", "generating", "exhausted"

    async def run(self) -> None:
        self.spawn(self.stream.run(self.settings.delta_interval_s), "flush")
        self.spawn(self._report_loop(), "report")
        self.spawn(self.weights.follow(self.versions_sub), "versions")
        if self.agents is not None:
            self.spawn(self.agents.announce_loop(), "announce")
        while not self.stopping.is_set():
            step = await self._decide()
            if step == self.EXHAUSTED:
                self.log.info("prompts_exhausted", batches=self.batches)
                return
            if step == self.IDLE and self._gated:  # shut for this version: only a wake opens it
                await self._wait_at_gate()
            elif step == self.IDLE:
                await self.work.wait_idle(self.stopping, self.settings.idle_wait_s)
            elif step == self.GENERATING:
                await self._await_room()
        await self.wait_stopped()

    async def _wait_at_gate(self) -> None:
        """The prompt pool's gate is shut for this version: wait for a wake (a newer version, the
        pool's gate_open), a stop, or gated_wait_s (a lost gate_open). A lost `weights.version` is
        seen by the relay's pointer moving, looked at every idle_wait_s (one stat, no ask), so it
        costs idle_wait_s; with no pointer to look at, only the wake or gated_wait_s end the wait."""
        s = self.settings
        stamp = self.weights.pointer_stamp()
        if stamp is None:
            await self.work.wait_idle(self.stopping, s.gated_wait_s)
            return
        deadline = time.monotonic() + s.gated_wait_s
        while (left := deadline - time.monotonic()) > 0:
            if await self.work.wait_idle(self.stopping, min(s.idle_wait_s, left)):
                return
            if self.weights.pointer_stamp() != stamp:
                return

    async def _decide(self) -> str:
        """One turn of the batch loop (see above): returns the next step."""
        self.work.room_freed.clear()  # before TakeBatch: a finish from here on wakes the refill wait
        async with self.work.lock:
            await self._settle_weights()
            if not self.active:
                # weights change only with nothing active, so this is every new version, and also a
                # drain that ended without one (a failed or deferred load): a batch's worth starts
                # again, so a failing load is not followed by a drain per intake
                self.taken_on_version = 0
            room = self._room()
            # batch_seq makes a retried TakeBatch (lost reply) return the same groups; None: it failed
            batch = await self._take_batch(room) if room > 0 else None
            for spec in batch.trajectories if batch else []:
                self._group_size = max(1, spec.group_size)
                self.runner.start(Active(spec=spec, version=self.version))
                self.taken_on_version += 1
            self._took = bool(batch and batch.trajectories)
            self._gated = bool(batch is not None and batch.gated and not batch.trajectories)
        if batch is None and not self.active and (self.weights.unnamed() or room > 0):
            return self.IDLE  # no weights named yet, or the TakeBatch failed: idle_wait_s, then again
        if batch is not None and not batch.trajectories and not self.active:
            return self.EXHAUSTED if batch.exhausted and self.settings.stop_when_exhausted else self.IDLE
        if batch is not None and batch.trajectories:
            self.batches += 1
        return self.GENERATING if self.active else self.AGAIN

    async def _settle_weights(self) -> None:
        """With nothing active: run queued adopted work on its own (older) version, else load the
        relay's newest version if it replaces ours. Work of an adopted version pins the engine to
        it until that work is done."""
        if not self.active:
            self.migration.pinned = False
        if self.migration.adopted and not self.active:
            await self.migration.run_adopted()
        else:
            await self.weights.update()

    def _room(self) -> int:
        """How many new trajectories to take now (0: none)."""
        room = self._intake() - len(self.active)  # migrated-in work counts
        if self.active and self._intake_early():  # those being stored take no room; one intake's worth at most
            room = min(self._intake() - len(self.work.generating), 2 * self._intake() - len(self.active))
        if self.migration.pinned or self.migration.adopted:
            return 0  # an old version's work runs alone; the queue waits for the batch to end
        if self.active and room < self._group_size:  # refill takes whole groups only
            return 0
        if self.active and self.refill and self._draining_for_newer():
            return 0  # newer weights wait on our relay: drain, then load them
        if self.weights.unnamed():
            return 0  # the engine holds weights it cannot name: load first (next turn)
        return room

    def _intake(self) -> int:
        """Trajectories this rollout holds at most: max_concurrency, or, refilling without a gate,
        only what its engine runs at once (max_num_seqs): a queue behind the running ones would add
        nothing to the engine's pace but would have to drain, on the old version, before the next
        one loads."""
        if self.refill and not self.gated and self.episodes is None and self.agents is None:  # episodes wait too
            return engine_seqs(self.settings)
        return self.settings.max_concurrency

    def _intake_early(self) -> bool:
        """Whether the next batch starts once nothing generates, while the last trajectories of the
        batch are still scored and stored (their puts wait on the buffer's disk; the engine need
        not): a batch loop without refill or gate, on weights the relay does not replace, with no
        adopted work pinning the engine to an older version and no episodes. Weights still change
        only with nothing active: when a newer version waits, the batch drains as before."""
        return (not self.refill and not self.gated and self.episodes is None and not self.migration.pinned
                and not self.migration.adopted and not self.weights.newer_waiting() and not self.weights.unnamed())

    async def _await_room(self) -> None:
        """Trajectories run: wait until one finishes (refill: room for new groups), until none
        generates (early intake), or until all have been stored."""
        self.work.state = "generating"
        if self.refill:
            await self.work.room_freed.wait()  # set by every finish (and by the last one)
        elif self._took and self._intake_early():  # (gen_done is already set if all ended by now)
            await self.work.gen_done.wait()
            if self.weights.shm_dir:  # a version no event or report told of yet counts too
                await self.weights.look_at_relay()
            if not self._intake_early():  # newer weights came meanwhile: drain, then load them
                await self.work.batch_done.wait()
        else:  # nothing new was taken (none left, or two intakes' worth held): wait for every store
            await self.work.batch_done.wait()
        if not self.active:
            self.work.state = "idle"

    async def _take_batch(self, room: int):
        """TakeBatch of up to `room` trajectories. It names this process (pid), so what it is handed
        is accounted to it: a restarted rollout's new groups are never requeued with the dead
        process's (the manager settles by pid). None when it was answered `internal` past call_acked's
        bound (logged there; counted in `take_failures`)."""
        try:
            return await self._call(self.prompts, TakeBatch(self.ctx.id, room, await self.seqs.at(self.batches),
                                                            self.version, pid=os.getpid()))
        except RemoteError as exc:
            if exc.code != "internal":
                raise
            self.take_failures += 1
            return None

    async def _report_loop(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.settings.report_interval_s)  # the reporting period
            overlapping = self.refill or (self.work.generating and self._intake_early())
            if overlapping and not self.gated and self.weights.shm_dir:
                await self.weights.look_at_relay()  # batches may overlap: see newer weights without a gap
            now = time.monotonic()
            rate = (self.work.generated - self._gen_at_last_report) / max(now - last, 1e-6)
            self._gen_at_last_report, last = self.work.generated, now
            s, w = self.engine.stats, self.weights
            self.pub.publish(f"rollout.stats.{self.ctx.id}", RolloutStats(
                rollout_id=self.ctx.id, host=self.ctx.host, version=w.version, kv_usage=s.kv_usage,
                running=s.running, waiting=s.waiting, active=len(self.active), tokens_per_s=rate,
                state=self.work.state, batches=self.batches, generated_tokens=self.work.generated,
                control_address=self._address("rollout", self.ctx.id), ts=time.time(), lineage=w.lineage,
                weight_pull_failures=w.pull_failures, puts_refused=self.runner.puts_refused, run_id=w.run_id))

    # -- lifecycle ---------------------------------------------------------------------------
    async def stop(self) -> None:
        self.stopping.set()
        for a in self.active.values():
            if a.task:
                a.task.cancel()
        await asyncio.gather(*(a.task for a in self.active.values() if a.task), return_exceptions=True)
        if self.stream is not None:
            await self.stream.flush()  # in-flight work stays in the partial pool for whoever resumes it
        await self.cancel_tasks()
        if self.versions_sub is not None:
            self.versions_sub.close()
        if self.server is not None:
            await self.server.close()
        if self.episodes is not None:
            await self.episodes.shutdown()
        if self.engine is not None:
            await self.engine.close()

    def status(self) -> dict:
        """Carried by every heartbeat, also while setup() still runs (until wired: holding nothing)."""
        w, kv = self.weights, self.engine.stats.kv_usage if self.engine else 0.0
        out = {"version": w.version if w else 0, "lineage": w.lineage if w else 0, "run_id": w.run_id if w else "",
               "active": len(self.active),
               "state": self.work.state, "batches": self.batches, "kv": round(kv, 3),
               "weight_pull_failures": w.pull_failures if w else 0,
               "puts_refused": self.runner.puts_refused if self.runner else 0,
               "fenced_off": self.stream.fenced_off if self.stream else 0,
               "gave_up": self.runner.gave_up if self.runner else 0, "take_failures": self.take_failures}
        if self.episodes is not None:
            out.update({f"env_{k}": v for k, v in self.episodes.counts.items()})
        if self.agents is not None:
            out.update(self.agents.status())
        return out
