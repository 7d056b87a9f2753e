"""EvaluatorRole: every `eval_every` versions, the newest weights answer a held-out split.

    setup: its own vLLM engine (EngineSettings, the rollouts' model: model_dir, max_model_len, ...), the
           held-out records (`dataset`, tokenized like the prompt pool does), the relay folder
    run:   evaluate version 0 (model_dir's weights, before any training), then follow the relay
           like a rollout: when its newest version is at least `eval_every` past the last one
           evaluated (or is the trainer's last, `max_iterations`), load it and evaluate it; after
           the last version, finish (exit 0), so `laminar-node up` waits for its last result. A
           last version the trainer reported (its metrics.trainer events and its heartbeats, which
           repeat, so a missed event costs nothing; heard from setup on) but the relay does not
           hold after `final_wait_s`, or a trainer silent for `trainer_silent_s` while the relay
           lacks the last version: the relay's newest is evaluated instead, and the role finishes.

One evaluation answers every problem of every eval set (sets.py: named held-out files, or the one
`heldout` set of `dataset`) greedily (temperature 0, when a metric needs it) and k times at the
set's temperature, scores each answer with the task's reward (`reward`, the rollouts' function:
1 = correct), and reports, per set, `eval/<set>/<metric>` (greedy, avg@k, pass@k, maj@k:
scoring.py), and for the first set the keys it always reported:

    eval/accuracy           share of problems answered correctly, greedy
    eval/accuracy_sampled   share of the sampled answers that are correct (avg@k: pass@1 at the temperature)
    eval/response_len_mean  mean sampled answer length (tokens), eval/problems, eval/seconds

With `best_metric`, the best version so far is kept (best.json, and its weights as a Hugging Face
folder in best/); with `log_samples`, a few (prompt, answer, reward) rows of each set go to
`<workdir>/samples.jsonl` (laminar/samples.py).

as a Metrics event (role "evaluator", topic `metrics.evaluator`: the live view, `status` and the
node's Prometheus exporter read it like the trainer's) and one line of
`<workdir>/evaluator/metrics.jsonl` (the summary's source). The held-out file is the evaluator's
only: the prompt pool never reads it, so no held-out problem is trained on.

Weights come from the relay's shared-memory folder, as a rollout's do; a version is named only
when the relay's pointer was the same before and after the load. The evaluator takes no work,
holds no trajectories and serves no requests: a crash loses at most one evaluation.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import ClassVar

from laminar.roles.evaluator.harness import Harness, load_sets, make_engine
from laminar.roles.evaluator.sets import BestKeeper, EvalSet, EvalSetConfig
from pydantic import ConfigDict, Field

from laminar.datasets import chat_template_field, system_prompt_field
from laminar.engine_settings import EngineSettings
from laminar.export import export
from laminar.protocol import Heartbeat, Metrics
from laminar.role_base import Role
from laminar.samples import SampleLog
from laminar.weights.manifest import ident
from laminar.weights.pull import LocalWeights
from laminar.weights.seal import arm_engine_checks


class EvaluatorConfig(EngineSettings):
    """Settings of the evaluator: its vLLM engine's (EngineSettings, as the rollouts'), the held-out
    split, its reward, when and how to evaluate."""
    model_config = ConfigDict(extra="forbid")
    MOVED: ClassVar[dict[str, str]] = {"weights_dir": "shm_dir"}  # older keys (laminar/config.py names them)
    dataset: str | None = Field(None, description="held-out JSONL/Parquet file (prompt, answer; never given to the "
                                "prompt pool): the one set `heldout` when `sets` is empty")
    sets: dict[str, EvalSetConfig] = Field(default_factory=dict, description="named eval sets (roles/evaluator/"
                                           "sets.py), each with its file, k samples, temperature and metrics; "
                                           "empty: the one set of dataset/samples/temperature")
    best_metric: str | None = Field(None, description="'<set>/<metric>' (e.g. heldout/greedy): the version scoring "
                                    "highest is kept in <workdir>/evaluator/best.json and exported to .../best/; "
                                    "None: none")
    answer: str | None = Field(None, description="maj@k's answer extractor 'module:fn' (spec, tokens) -> str | None "
                               "(e.g. laminar.tasks.math:math_answer); None: identical responses vote together")
    log_samples: int = Field(8, ge=0, description="rows of each set written to <workdir>/samples.jsonl at each "
                             "evaluation (laminar/samples.py); 0: none")
    prompt_field: str = Field("prompt", description="record field with the prompt text")
    answer_field: str = Field("answer", description="record field with the reference answer")
    id_field: str | None = Field("id", description="record field with the problem id")
    limit: int | None = Field(None, ge=1, description="evaluate only the first `limit` records")
    tokenizer_dir: str | None = Field(None, description="model folder whose tokenizer encodes the prompts "
                                      "(default: the byte tokenizer, as the prompt pool)")
    chat_template: str = chat_template_field()
    system_prompt: str | None = system_prompt_field()
    reward: str = Field("laminar.tasks.math:math_reward", description="reward function 'module:fn' (1 = correct)")
    eval_every: int = Field(5, ge=1, description="evaluate every this many versions (and version 0, and the last)")
    last_version: int | None = Field(None, ge=1, description="the run's last version: evaluated, then the role "
                                     "finishes (default: the trainer's max_iterations; None there: run until stopped)")
    samples: int = Field(4, ge=0, description="sampled answers per problem (0: greedy only; the `heldout` set)")
    temperature: float = Field(1.0, gt=0, description="temperature of the sampled answers (the `heldout` set; "
                               "greedy answers are their own metric, so 0 is refused as for any set's)")
    max_tokens: int = Field(256, ge=1, description="answer token budget (the prompt pool's max_tokens)")
    seed: int = Field(0, description="sampling seed (per answer: hash of seed, version, problem, sample)")
    max_concurrency: int = Field(64, ge=1, description="answers generated at once (the engine's max_num_seqs "
                                 "unless that is set)")
    relay_id: str | None = Field(None, description="relay on this host to take weights from")
    shm_dir: str | None = Field(None, description="that relay's shared-memory folder (default: the relay's own "
                                "shm_dir)")
    poll_s: float = Field(0.5, gt=0, description="how often the relay's newest version is looked at")
    final_wait_s: float = Field(20.0, gt=0, description="once the trainer reported its last version: how long to "
                                "wait for it on the relay before evaluating the relay's newest and finishing")
    trainer_silent_s: float = Field(60.0, gt=0, description="no trainer heartbeat or metrics for this long while the "
                                    "relay lacks the last version: the trainer is gone; evaluate the relay's newest "
                                    "and finish")


def accuracy(rewards: list[float]) -> float:
    """Share of answers with reward >= 1 (correct); 0 for none."""
    return sum(1 for r in rewards if r >= 1.0) / len(rewards) if rewards else 0.0


def give_up_waiting(trainer_version: int, last_version: int | None, relay_version: int, since: float | None,
                    now: float, wait_s: float) -> bool:
    """Whether to stop waiting for the last version on the relay: the trainer reported it (at
    `since`) more than `wait_s` ago and the relay still holds an older one."""
    if last_version is None or trainer_version < last_version or relay_version >= last_version or since is None:
        return False
    return now - since > wait_s


def heard_version(ev) -> int | None:
    """The trainer's version in one of its Metrics events or heartbeats (None: not in it)."""
    if isinstance(ev, Heartbeat):
        v = ev.status.get("version") if isinstance(ev.status, dict) else None
    elif isinstance(ev, Metrics):
        v = ev.values.get("version") if isinstance(ev.values, dict) else None
    else:
        return None
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def trainer_gone(last_version: int | None, relay_version: int, heard_at: float, now: float, silent_s: float) -> bool:
    """Whether to stop waiting because the trainer has been silent for `silent_s` (it finished or
    died unheard) while the relay still lacks the last version."""
    return last_version is not None and relay_version < last_version and now - heard_at > silent_s


def due(version: int, last_evaluated: int, eval_every: int, last_version: int | None) -> bool:
    """Whether the relay's newest `version` is evaluated, the last evaluated being `last_evaluated`."""
    if version <= last_evaluated:
        return False
    return version - last_evaluated >= eval_every or (last_version is not None and version >= last_version)


class EvaluatorRole(Role):
    """Evaluates weight versions on held-out sets with its own engine, off the training path."""
    name = "evaluator"
    Config = EvaluatorConfig

    def __init__(self, ctx):
        super().__init__(ctx)
        self.version = -1
        self.trainer_version, self.trainer_done_at = -1, None  # the trainer's newest reported version
        self.trainer_heard_at = time.monotonic()
        self.trainer_sub = None
        self.relay_version = -1
        self.lineage: int | None = None
        self.evaluated: list[int] = []
        self.last: dict[str, float] = {}
        self.engine = None
        self.state = "starting"

    def status(self) -> dict:
        """Heartbeat status: the weights held, and the newest evaluation (version and accuracies)."""
        out = {"state": self.state, "version": self.version, "evaluations": len(self.evaluated)}
        if self.last:
            out["eval_version"] = int(self.last["version"])
            out.update({k.split("/", 1)[1]: round(v, 4) for k, v in self.last.items() if k.startswith("eval/accuracy")})
        return out

    async def setup(self) -> None:
        c, cluster = self.settings, self.cluster
        self.sets: list[EvalSet] = await asyncio.to_thread(load_sets, c)
        self.problems = self.sets[0].problems
        self.last_version = c.last_version
        self.shm_dir = c.shm_dir
        if cluster is not None:
            if self.last_version is None and cluster.find("trainer"):
                self.last_version = cluster.role_settings("trainer").get("max_iterations")
            if c.relay_id is not None and self.shm_dir is None:
                self.shm_dir = cluster.relay_shm_dir(c.relay_id)
            self.out = cluster.workdir() / "evaluator"
        else:
            self.out = Path(self.ctx.settings.get("out_dir", "evaluator"))
        self.out.mkdir(parents=True, exist_ok=True)
        self.best = BestKeeper(self.out, c.best_metric)
        self.sample_log = SampleLog(self.out.parent / "samples.jsonl", c.tokenizer_dir) if c.log_samples else None
        # heard from now on, before the engine starts: a trainer that reaches its last version while
        # the first evaluation runs is not missed (a subscription made later can miss its events)
        self.trainer_sub = self.ctx.transport.subscriber(["metrics.trainer", "hb.trainer."])
        self.trainer_heard_at = time.monotonic()
        cores = cluster.spec("evaluator", self.ctx.id)[1].cores if cluster is not None else None
        self.engine = make_engine(c, omp_threads_bind=c.omp_bind(cores))
        # its worker processes check each version's seals before they load it, as a rollout's do;
        # the best version's export checks them too (laminar/export.py)
        arm_engine_checks(getattr(self.ctx.transport, "keys", None))
        await self.engine.start()
        self.harness = Harness(self.engine, self.sets, c)
        self.version, self.lineage = 0, None  # model_dir's weights: version 0 of no lineage
        self.log.info("evaluator_ready", problems=len(self.problems), eval_every=c.eval_every,
                      last_version=self.last_version, shm_dir=self.shm_dir)

    async def run(self) -> None:
        await self.evaluate()  # version 0: the initial weights, before any training
        if not self.shm_dir:
            self.log.info("evaluations_done", versions=self.evaluated, why="no relay to take newer weights from")
            return
        self.spawn(self._follow_trainer(), "trainer")
        while not self.stopping.is_set():
            if self.last_version is not None and self.evaluated and self.evaluated[-1] >= self.last_version:
                self.log.info("evaluations_done", versions=self.evaluated)
                return
            if await self._load_due():
                await self.evaluate()
                continue
            now = time.monotonic()
            why = ("the last version did not reach the relay"
                   if give_up_waiting(self.trainer_version, self.last_version, self.relay_version,
                                      self.trainer_done_at, now, self.settings.final_wait_s)
                   else "the trainer went silent before the last version reached the relay"
                   if trainer_gone(self.last_version, self.relay_version, self.trainer_heard_at, now,
                                   self.settings.trainer_silent_s) else "")
            if why:  # evaluate the newest version the relay holds, and finish
                if self.relay_version > (self.evaluated[-1] if self.evaluated else -1) and await self._load_due(True):
                    await self.evaluate()
                self.log.warning("evaluations_done", versions=self.evaluated, trainer_version=self.trainer_version,
                                 relay_version=self.relay_version, why=why)
                return
            self.state = "waiting"
            try:
                await asyncio.wait_for(self.stopping.wait(), self.settings.poll_s)
            except TimeoutError:
                pass

    async def _follow_trainer(self) -> None:
        """The trainer's versions (its Metrics events and heartbeats): when it was last heard, and
        when it reported the last one."""
        while True:
            _, ev = await self.trainer_sub.recv()
            v = heard_version(ev)
            if v is None:
                continue
            self.trainer_heard_at = time.monotonic()
            if v > self.trainer_version:
                self.trainer_version = v
                if self.last_version is not None and v >= self.last_version and self.trainer_done_at is None:
                    self.trainer_done_at = time.monotonic()

    async def _load_due(self, force: bool = False) -> bool:
        """Load the relay's newest version if it is due (or `force`); True when loaded and named."""
        if not self.shm_dir:
            return False
        lw = LocalWeights(self.shm_dir)
        try:
            m = await asyncio.to_thread(lw.manifest)
        except (OSError, ValueError) as exc:
            self.log.warning("eval_weights_unreadable", error=repr(exc))
            return False
        last = self.evaluated[-1] if self.evaluated else -1
        if m is None:
            return False
        self.relay_version = m.version
        # a new lineage (a resumed trainer) replaces what was evaluated: evaluate it at once; the
        # first relay version after model_dir's weights (lineage None) waits its turn like any other
        new_lineage = self.lineage is not None and m.lineage != self.lineage
        if not force and not new_lineage and not due(m.version, last, self.settings.eval_every, self.last_version):
            return False
        self.state = "loading"
        for _ in range(3):
            try:
                got = await self.engine.load_relay(self.shm_dir, -1)
                after = await asyncio.to_thread(lw.manifest)
            except Exception as exc:  # noqa: BLE001 - keep the weights held; try again on the next poll
                self.log.warning("eval_weights_load_failed", version=m.version, error=repr(exc))
                return False
            if got >= 0 and after is not None and ident(after) == ident(m) and got == m.version:
                self.version, self.lineage = got, m.lineage
                return True
            if after is None:
                return False
            m = after  # the relay committed a version during the load: load again
        return False

    async def evaluate(self) -> dict:
        """Answer every eval set with the weights held now (the harness); publish and record the result."""
        c, v = self.settings, self.version
        self.state = "evaluating"
        result = await self.harness.evaluate(v)
        values = result.values
        if self.sample_log is not None:
            for name, rows in result.rows.items():
                if rows:
                    await asyncio.to_thread(self.sample_log.write, f"eval/{name}", v, rows[:c.log_samples])
        self.evaluated.append(v)
        self.last = values
        if self.best.better(values):
            await self._keep_best(v, values)
        ts = time.time()
        await asyncio.to_thread(self._record, result, ts)
        self.pub.publish("metrics.evaluator", Metrics(role="evaluator", id=self.ctx.id, ts=ts, values=values))
        self.log.info("evaluated", version=v, accuracy=round(values.get("eval/accuracy", float("nan")), 4),
                      accuracy_sampled=round(values.get("eval/accuracy_sampled", float("nan")), 4),
                      seconds=round(values["eval/seconds"], 2),
                      **{k.split("/", 1)[1]: round(x, 4) for k, x in values.items() if k.count("/") == 2})
        self.state = "waiting"
        return values

    def _record(self, result, ts: float) -> None:
        """One line of metrics.jsonl (the values) and one of scores.jsonl (each problem's scores,
        for the summary's paired comparison of the first and last versions)."""
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps({**result.values, "lineage": self.lineage, "ts": ts}) + "\n")
        with open(self.out / "scores.jsonl", "a") as f:
            f.write(json.dumps({"version": int(result.values["version"]), "lineage": self.lineage, "ts": ts,
                                "sets": {n: {"ids": result.prompt_ids[n], "scores": sc}
                                         for n, sc in result.scores.items()}}) + "\n")

    async def _keep_best(self, v: int, values: dict) -> None:
        """A new best version: its weights (the relay's copy; version 0: model_dir's) to best/."""
        c = self.settings
        src = self.shm_dir if (v > 0 and self.shm_dir) else None
        do = (lambda out: export(src, out, c.model_dir, version=v)) if src else None
        try:
            best = await asyncio.to_thread(self.best.record, v, self.lineage, values, do)
        except Exception as exc:  # noqa: BLE001 - the relay dropped that version meanwhile: say so, keep going
            self.log.warning("eval_best_not_exported", version=v, error=repr(exc))
            best = await asyncio.to_thread(self.best.record, v, self.lineage, values, None)
        self.log.info("eval_best", version=v, metric=c.best_metric, value=round(best["value"], 4),
                      export=best["export"])

    async def stop(self) -> None:
        self.stopping.set()
        await self.cancel_tasks()
        if self.engine is not None:
            await self.engine.close()
            self.engine = None
