"""PromptPoolRole: TakeBatch -> whole GRPO groups; RequeueGroups -> handed out again first.

Idempotent: a TakeBatch with a `batch_seq` that repeats the rollout's last one (its reply was
lost) gets the same groups again. Order: epoch e visits the prompts in a permutation seeded by (seed, e). The cursor (epoch,
position) and the requeue list are durable; a TakeBatch is answered only after the cursor move is
committed, so a restarted pool never hands a group out twice (and a lost reply is covered by the
manager's requeue of the groups it knows were lost). Whole groups only: a batch holds
floor(max_trajectories / n) groups, but at least one when asked for fewer than n.
"""
from __future__ import annotations

import json

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from laminar.protocol import Ack, Batch, RequeueGroups, TakeBatch, TrajectorySpec
from laminar.roles.pool_base import PoolRole


class PromptPoolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dataset: str = Field(description="JSONL/Parquet file or folder (relative to the working directory)")
    prompt_field: str = Field("prompt", description="record field with the prompt text")
    answer_field: str = Field("answer", description="record field with the reference answer")
    id_field: str | None = Field(None, description="record field with a stable prompt id (default: row number)")
    on_bad_row: str = Field("error", pattern="^(error|skip)$", description="malformed row: fail or skip")
    tokenizer_dir: str | None = Field(None, description="model folder whose tokenizer to use (default: byte tokenizer)")
    group_size: int = Field(4, ge=1, description="GRPO group size n (responses per prompt)")
    max_tokens: int = Field(256, ge=1, description="response token budget of each trajectory")
    max_epochs: int | None = Field(None, ge=1, description="stop handing out after this many epochs (None: forever)")
    seed: int = Field(0, description="shuffle seed")
    store_dir: str | None = Field(None, description="folder of the SQLite store (default: <workdir>/pools)")
    groups_per_version: int | None = Field(None, ge=1, description="groups of one global batch, for the barrier "
                                           "modes' gate and max_batches_ahead (default: the trainer's groups_per_batch)")
    max_batches_ahead: int | None = Field(None, ge=0, description="laminar modes, flow control: a rollout holding "
                                          "version v gets groups only while fewer than v + 1 + this many global batches "
                                          "were handed out, so generation cannot run further ahead of training than "
                                          "that (when rollouts outpace the trainer, what they make beyond it would only "
                                          "grow stale in the buffer). None: no bound (the paper's setting). Unlike a "
                                          "barrier mode's gate this never holds weights back: a rollout still loads the "
                                          "newest version whenever its own batch ends")
    max_batch_trajectories: int = Field(65_536, ge=1, description="most trajectories one TakeBatch gets, "
                                        "whatever it asks for (a bound on the work and memory of one request)")


SCHEMA = """
CREATE TABLE IF NOT EXISTS cursor (k INTEGER PRIMARY KEY CHECK (k = 0), epoch INTEGER, pos INTEGER, handed INTEGER);
CREATE TABLE IF NOT EXISTS requeued (group_id TEXT PRIMARY KEY, at REAL);
CREATE TABLE IF NOT EXISTS last_batch (rollout_id TEXT PRIMARY KEY, seq INTEGER, groups TEXT);
"""


class PromptPoolRole(PoolRole):
    name = "prompt_pool"
    Config = PromptPoolConfig
    SCHEMA = SCHEMA

    async def setup(self) -> None:
        from laminar.datasets import load_records, load_tokenizer
        c = self.cfg
        self.records, self.skipped = load_records(c.dataset, c.prompt_field, c.answer_field, c.id_field, c.on_bad_row)
        tok = load_tokenizer(c.tokenizer_dir)
        self.tokens = [np.asarray(tok.encode(r.prompt), dtype=np.int32) for r in self.records]
        self.index = {r.prompt_id: i for i, r in enumerate(self.records)}
        self.gate = self._gate()
        await super().setup()

    def _gate(self) -> tuple[int, int] | None:
        """(lag, groups per version): a rollout holding version v gets groups only while fewer than
        (v + 1 + lag) global batches were handed out. The barrier modes' lag (DESIGN §7), or in the
        laminar modes `max_batches_ahead` (flow control), or None (no gate)."""
        cfg = self.ctx.config
        lag = cfg.run.barrier_lag if cfg is not None else None
        why = "barrier_gate"
        if lag is None:
            lag, why = self.cfg.max_batches_ahead, "flow_control_gate"
        if lag is None:
            return None
        g = self.cfg.groups_per_version
        if g is None:
            from laminar.config import ConfigError
            from laminar.roles.trainer.config import TrainerConfig
            try:
                settings = cfg.role_settings("trainer", "0")
            except ConfigError:  # no trainer placed in this config: the roles.trainer section
                settings = cfg.roles.get("trainer", {})
            g = TrainerConfig(**settings).groups_per_batch
        self.log.info(why, mode=cfg.run.mode if cfg is not None else None, lag=lag, groups_per_version=g)
        return lag, g

    def recover(self) -> None:
        row = self.store.read("SELECT epoch, pos, handed FROM cursor WHERE k = 0")
        self.epoch, self.pos, self.handed = row[0] if row else (0, 0, 0)
        self.requeued = [g for (g,) in self.store.read("SELECT group_id FROM requeued ORDER BY at")]
        self.last = {r: (seq, json.loads(gs)) for r, seq, gs in self.store.read("SELECT rollout_id, seq, groups FROM last_batch")}
        self._order_epoch = -1

    def routes(self) -> None:
        self.route(TakeBatch, self.on_take)
        self.route(RequeueGroups, self.on_requeue)

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            self._perm = np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.records))
            self._order_epoch = epoch
        return self._perm

    def exhausted(self) -> bool:
        return self.cfg.max_epochs is not None and self.epoch >= self.cfg.max_epochs and not self.requeued

    def _group(self, epoch: int, idx: int) -> list[TrajectorySpec]:
        r, n = self.records[idx], self.cfg.group_size
        gid = f"{self.prefix}e{epoch}-p{r.prompt_id}"
        return [TrajectorySpec(trajectory_id=f"{gid}/{i}", prompt_id=r.prompt_id, group_id=gid, sample_index=i,
                               group_size=n, prompt_tokens=self.tokens[idx], answer=r.answer,
                               max_tokens=self.cfg.max_tokens) for i in range(n)]

    @property
    def prefix(self) -> str:
        """Group ids are unique across prompt pools: pools other than "0" prefix their id."""
        return "" if self.ctx.id == "0" else f"{self.ctx.id}."

    def _parse(self, group_id: str) -> tuple[int, str] | None:
        if not group_id.startswith(self.prefix + "e"):
            return None
        e, sep, pid = group_id[len(self.prefix) + 1:].partition("-p")
        return (int(e), pid) if sep and e.isdigit() and pid in self.index else None

    def _specs_of(self, group_id: str) -> list[TrajectorySpec]:
        e, pid = self._parse(group_id)
        return self._group(e, self.index[pid])

    async def on_take(self, req: TakeBatch) -> Batch:
        last = self.last.get(req.rollout_id)
        if req.batch_seq >= 0 and last is not None and last[0] == req.batch_seq:  # a retry
            await self.durable([])  # its answer stands once the original's cursor move is on disk
            return Batch([s for g in last[1] for s in self._specs_of(g)], exhausted=self.exhausted())
        n = self.cfg.group_size
        want = max(1, min(req.max_trajectories, self.cfg.max_batch_trajectories) // n)
        # Requeued groups (work lost with a rollout) go out first and pass the gate: they belong to
        # batches already counted, which the trainer may be waiting for. The gate bounds the fresh
        # groups, and `handed` counts only those.
        fresh_room = want
        if self.gate is not None and req.version >= 0:
            lag, g = self.gate
            fresh_room = (req.version + 1 + lag) * g - self.handed
        out: list[TrajectorySpec] = []
        took_requeued = []
        while len(out) // n < want and len(took_requeued) < len(self.requeued):
            gid = self.requeued[len(took_requeued)]
            took_requeued.append(gid)
            out += self._specs_of(gid)
        epoch, pos, fresh = self.epoch, self.pos, 0
        while len(out) // n < want and fresh < fresh_room:
            if self.cfg.max_epochs is not None and epoch >= self.cfg.max_epochs:
                break
            out += self._group(epoch, int(self._order(epoch)[pos]))
            fresh += 1
            pos += 1
            if pos == len(self.records):
                epoch, pos = epoch + 1, 0
        if not out:  # exhausted, or (gated) this version's share is out: wait for the next version
            return Batch([], exhausted=self.exhausted())
        # Commit the cursor move before answering; memory follows only after it is durable.
        stmts = [("INSERT OR REPLACE INTO cursor (k, epoch, pos, handed) VALUES (0, ?, ?, ?)",
                  (epoch, pos, self.handed + fresh))]
        stmts += [("DELETE FROM requeued WHERE group_id = ?", (g,)) for g in took_requeued]
        if req.batch_seq >= 0:
            groups = list(dict.fromkeys(s.group_id for s in out))
            self.last[req.rollout_id] = (req.batch_seq, groups)
            stmts.append(("INSERT OR REPLACE INTO last_batch VALUES (?, ?, ?)",
                          (req.rollout_id, req.batch_seq, json.dumps(groups))))
        self.epoch, self.pos, self.handed = epoch, pos, self.handed + fresh
        self.requeued = self.requeued[len(took_requeued):]
        await self.durable(stmts)
        return Batch(out, exhausted=self.exhausted())

    async def on_requeue(self, req: RequeueGroups) -> Ack:
        new = [g for g in req.group_ids if g not in self.requeued]
        for g in new:
            if self._parse(g) is None:
                from laminar.bus.rpc import RequestError
                raise RequestError("refused", f"unknown group id {g!r} for prompt pool {self.ctx.id}")
        self.requeued += new
        import time
        await self.durable([("INSERT OR IGNORE INTO requeued (group_id, at) VALUES (?, ?)", (g, time.time())) for g in new])
        return Ack(f"requeued {len(new)}")

    def counts(self) -> dict:
        return {"epoch": self.epoch, "position": self.pos, "groups_handed": self.handed,
                "requeued": len(self.requeued), "prompts": len(self.records), "skipped_rows": self.skipped}
