"""Evaluating weights on eval sets: what the evaluator role and `laminar-node eval` share, so both
give the same numbers for the same weights and version.

    sets = load_sets(settings)                  # records read, prompts tokenized, rewards imported
    engine = make_engine(settings)              # vLLM with the evaluator's settings; await engine.start()
    result = await Harness(engine, sets, settings).evaluate(version)

Every problem of every set is answered greedily (temperature 0, when a metric needs it) and k
times at the set's temperature, each sampled answer seeded by a hash of (seed, set, version,
problem, sample) (without named `sets`: of (seed, version, problem, sample), the seeds the one
held-out split always had), so the same weights evaluated as the same version give the same
answers wherever they run. Each answer is scored with the set's reward (1 = correct), and the
result's values are:

    eval/<set>/<metric>           the mean over the set's problems (scoring.py: greedy, avg@k, pass@k, maj@k)
    eval/<set>/<metric>/lo, /hi   its 95% interval (laminar/intervals.py: Wilson for 0/1 scores, else a
                                  bootstrap over problems)
    eval/<set>/problems, eval/<set>/response_len_mean
    eval/accuracy, eval/accuracy_sampled   the first set's greedy and largest avg@k (older runs' keys)
    eval/problems, eval/response_len_mean, eval/seconds

besides each problem's scores (for paired comparisons of two versions) and one sample row per
problem (its first sampled answer).
"""
from __future__ import annotations

import asyncio
import time
import zlib
from dataclasses import dataclass, field
from types import SimpleNamespace

from laminar.roles.evaluator.scoring import ProblemResult, per_problem, score_with_intervals
from laminar.roles.evaluator.sets import EvalSet, legacy_keys, set_configs

from laminar.datasets import load_records, prompt_encoder, tokenize_records
from laminar.engine_settings import engine_seqs
from laminar.tasks import load_callable


def load_sets(c) -> list[EvalSet]:
    """The evaluator settings' eval sets (sets.py), their records read and prompts tokenized (as
    the prompt pool tokenizes them), their reward and answer functions imported."""
    reward = load_callable(c.reward)
    encoder = prompt_encoder(c.tokenizer_dir, c.chat_template, c.system_prompt)
    out = []
    for name, s in set_configs(c).items():
        records, _ = load_records(s.dataset, s.prompt_field, s.answer_field, s.id_field)
        problems = tokenize_records(records[:s.limit] if s.limit else records, encoder)
        if not problems:
            raise ValueError(f"{s.dataset}: no held-out records (evaluator set {name!r})")
        answer = s.answer or c.answer
        out.append(EvalSet(name, s, problems, load_callable(s.reward) if s.reward else reward,
                           load_callable(answer) if answer else None))
    return out


def make_engine(c, model_dir: str | None = None, omp_threads_bind: str | None = None):
    """The vLLM engine of the evaluator settings `c` (EngineSettings; not started), on `model_dir`
    (default: c.model_dir)."""
    from laminar.roles.rollout.engine import VllmEngine  # late: the engine module pulls vLLM's helpers
    settings = c if model_dir is None else c.model_copy(update={"model_dir": model_dir})
    return VllmEngine.from_settings(settings, max_num_seqs=engine_seqs(c), temperature=c.temperature, top_p=1.0,
                                    seeded=True, omp_threads_bind=omp_threads_bind)


@dataclass
class EvalResult:
    """One evaluation of one version: the values (module docstring), each set's per-problem scores
    {set: {metric: [score per problem]}} with the problems' ids, and its sample rows {set: rows}."""
    values: dict[str, float]
    scores: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    prompt_ids: dict[str, list[str]] = field(default_factory=dict)
    rows: dict[str, list[dict]] = field(default_factory=dict)


class Harness:
    """Answers and scores eval sets with a started engine (its weights are the version evaluated).
    `progress(set_name, answered, total, seconds)`, when given, is called as a set's answers come
    in (at most every `progress_every_s` seconds, and once when the set is done)."""

    def __init__(self, engine, sets: list[EvalSet], settings, progress=None, progress_every_s: float = 30.0):
        self.engine, self.sets, self.settings = engine, sets, settings
        self.legacy_seeds = not settings.sets  # the one `heldout` set keeps the seeds it always had
        self.progress, self.progress_every_s = progress, progress_every_s

    async def gather_with_progress(self, name: str, jobs: list) -> list:
        """The jobs' results in order; with `progress`, a call per `progress_every_s` and one at the end."""
        if self.progress is None:
            return await asyncio.gather(*jobs)
        t0 = time.monotonic()
        done = [0, t0]   # answered, time of the last report

        async def counted(job):
            got = await job
            done[0] += 1
            now = time.monotonic()
            if now - done[1] >= self.progress_every_s:
                done[1] = now
                self.progress(name, done[0], len(jobs), now - t0)
            return got
        out = await asyncio.gather(*(counted(j) for j in jobs))
        self.progress(name, len(jobs), len(jobs), time.monotonic() - t0)
        return out

    async def answer(self, rid: str, prompt, temperature: float, seed: int | None) -> list[int]:
        from vllm import SamplingParams  # late: vLLM, loaded only in an engine process
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        sp = SamplingParams(max_tokens=self.settings.max_tokens, temperature=temperature, top_p=1.0, seed=seed,
                            detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        tokens: list[int] = []
        adapters = getattr(self.engine, "adapters", None)
        lora = adapters.current if adapters is not None else None  # the version's adapter
        async for out in self.engine.llm.generate(TokensPrompt(prompt_token_ids=[int(t) for t in prompt]), sp,
                                                  request_id=rid, lora_request=lora):
            tokens = list(out.outputs[0].token_ids)
        return tokens

    def seed(self, es: EvalSet, v: int, prompt_id: str, s: int) -> int:
        c = self.settings
        key = f"{c.seed}:{v}:{prompt_id}:{s}" if self.legacy_seeds else f"{c.seed}:{es.name}:{v}:{prompt_id}:{s}"
        return zlib.crc32(key.encode())

    async def answer_set(self, es: EvalSet, v: int) -> tuple[dict[str, float], list[ProblemResult], list[dict]]:
        """Every problem of one set: greedy (when a metric needs it) and k sampled answers, scored."""
        jobs, kinds = [], []
        for i, p in enumerate(es.problems):
            if es.greedy:
                jobs.append(self.answer(f"eval-v{v}-{es.name}-{i}-g", p.prompt_tokens, 0.0, None))
                kinds.append((i, -1))
            for s in range(es.settings.k):
                jobs.append(self.answer(f"eval-v{v}-{es.name}-{i}-s{s}", p.prompt_tokens, es.settings.temperature,
                                        self.seed(es, v, p.prompt_id, s)))
                kinds.append((i, s))
        answers = await self.gather_with_progress(es.name, jobs)
        results = [ProblemResult() for _ in es.problems]
        rows, lens = [], []
        for (i, s), toks in zip(kinds, answers, strict=True):
            p = es.problems[i]
            spec = SimpleNamespace(prompt_id=p.prompt_id, answer=p.answer, max_tokens=self.settings.max_tokens,
                                   prompt_tokens=p.prompt_tokens)
            r = float(es.reward(spec, toks))
            if s < 0:
                results[i].greedy = r >= 1.0
                continue
            results[i].correct.append(r >= 1.0)
            results[i].answers.append(es.answer(spec, toks) if es.answer is not None else tuple(toks))
            lens.append(len(toks))
            if s == 0:
                rows.append({"prompt_tokens": p.prompt_tokens, "response_tokens": toks, "reward": r,
                             "prompt_id": p.prompt_id})
        values = {}
        for m, (mean, lo, hi) in score_with_intervals(results, es.settings.metrics).items():
            values.update({f"eval/{es.name}/{m}": mean, f"eval/{es.name}/{m}/lo": lo, f"eval/{es.name}/{m}/hi": hi})
        values[f"eval/{es.name}/problems"] = float(len(es.problems))
        if lens:
            values[f"eval/{es.name}/response_len_mean"] = sum(lens) / len(lens)
        return values, results, rows

    async def evaluate(self, v: int) -> EvalResult:
        """Every set answered with the engine's weights, as version `v` (which seeds the samples)."""
        t0 = time.monotonic()
        out = EvalResult({"version": float(v)})
        for es in self.sets:
            got, results, rows = await self.answer_set(es, v)
            out.values.update(got)
            out.scores[es.name] = per_problem(results, es.settings.metrics)
            out.prompt_ids[es.name] = [p.prompt_id for p in es.problems]
            out.rows[es.name] = rows
        first = self.sets[0]
        out.values.update(legacy_keys(first.name, out.values, first.settings.metrics))
        out.values["eval/problems"] = float(len(first.problems))
        if f"eval/{first.name}/response_len_mean" in out.values:
            out.values["eval/response_len_mean"] = out.values[f"eval/{first.name}/response_len_mean"]
        out.values["eval/seconds"] = time.monotonic() - t0
        return out
