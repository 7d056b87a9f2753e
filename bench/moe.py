"""Train-inference mismatch of a mixture-of-experts policy, with and without routing replay.

    python bench/moe.py [--moe-model DIR] [--dense-model DIR] [--versions 20] [--out F]

Correctness numbers, not timings. Both models run in float32: vLLM's CPU build samples
`--sequences` responses (temperature 1, seeded) and reports each token's behaviour logprob and, for
the MoE model, the experts its routers chose at every position (the worker's capture,
roles/rollout/moe_worker.py); the trainer's logprob pass (TrainEngine, the one every pass uses)
recomputes the same tokens' logprobs. Per token:

- |Δlogprob| = |trainer - vLLM|: mean and p99, for the MoE model without replay (the trainer's own
  top-k) and with it (the recorded experts: roles/trainer/routing_replay.py), beside the dense tiny
  model's (no routing: what float32 numerics alone leave);
- top-k disagreement without replay: the share of response tokens whose position's expert set
  differs, in some layer, between the trainer's router and vLLM's (replay makes it 0 by
  construction); and per (token, layer);
- routing bytes per token (uint8 [layers, top_k] per position) and per trajectory.

Then `--versions` GRPO versions train each model on the uppercase task (reward: the share of
capitals; vLLM samples every version, the trainer trains with replay on, its weights go back into
the engine in place), and the same measurement runs again on the trained weights.

--moe-model: a tiny Qwen3-MoE folder (default models/tiny-moe when built: `make models/tiny-moe`,
random-init then warm-started); "" (or none built) builds a random one (init std 0.02).
--dense-model likewise (the tiny Qwen2, models/tiny). --dtype bfloat16 runs the engine in bf16 and
the trainer under bf16 autocast (fp32 master weights), as GPU runs do; float32 is the default.
Writes JSON with `mismatch_mean_replay`, `mismatch_mean_noreplay`, `topk_disagree_noreplay`,
`routing_bytes_per_token` (and p99s, the dense model's, and `after_versions` with the same keys).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import exit_on_signals, percentile, print_table, write_json  # noqa: E402
from laminar.roles.rollout.engine import VllmEngine  # noqa: E402
from laminar.roles.trainer.config import TrainerConfig  # noqa: E402
from laminar.roles.trainer.engine import TrainEngine  # noqa: E402

from laminar.datasets import ByteTokenizer  # noqa: E402
from laminar.models.tiny import build_tiny_model, build_tiny_moe_model  # noqa: E402
from laminar.protocol import Trajectory, TrajectorySpec  # noqa: E402
from laminar.tasks.demo_data import make_prompts  # noqa: E402
from laminar.tasks.rewards import upper_fraction  # noqa: E402
from laminar.testing.moe import hf_routing  # noqa: E402

TOK = ByteTokenizer()


def specs(n_prompts: int, group: int, max_tokens: int, tag: str) -> list[TrajectorySpec]:
    prompts = make_prompts(n_prompts, seed=zlib.crc32(tag.encode()) % 1000)
    return [TrajectorySpec(trajectory_id=f"{tag}-{p}-{i}", prompt_id=f"{tag}-{p}", group_id=f"{tag}-{p}",
                           sample_index=i, group_size=group,
                           prompt_tokens=np.asarray(TOK.encode(r["prompt"]), np.int32), max_tokens=max_tokens)
            for p, r in enumerate(prompts) for i in range(group)]


async def sample(engine: VllmEngine, todo: list[TrajectorySpec], version: int, seed: int) -> list[list[Trajectory]]:
    """One response per spec, its behaviour logprobs and (MoE) routing; grouped by group id."""
    async def one(k, s):
        rid, toks, lps = f"{s.trajectory_id}#v{version}", [], []
        prompt = [int(t) for t in s.prompt_tokens]
        async for t, lp, _ in engine.generate(rid, prompt, s.max_tokens, seed=seed * 100_003 + k):
            toks += t
            lps += lp
        got = (await engine.routing([(rid, 0, len(prompt) + len(toks))], [rid]))[0]
        resp = np.asarray(toks, np.int32)
        return Trajectory(spec=s, response_tokens=resp, logprobs=np.asarray(lps, np.float32), version=version,
                          rollout_id="bench", reward=upper_fraction(s, resp), routing=None if got is None else got[1])
    trajs = await asyncio.gather(*(one(k, s) for k, s in enumerate(todo)))
    groups: dict[str, list] = {}
    for t in trajs:
        groups.setdefault(t.spec.group_id, []).append(t)
    return list(groups.values())


def trainer_logprobs(te: TrainEngine, trajs, replay: bool) -> list[np.ndarray]:
    """The trainer's logprob pass over `trajs` (replay on or off for a MoE policy)."""
    if te.models.moe is not None:
        te.models.moe.replay = replay
    te.forwards.new_batch()
    out = te.forwards.model_logprobs(te.models.model, trajs, list(range(len(trajs))))
    if te.models.moe is not None:
        te.models.moe.clear()
        te.models.moe.replay = True
    return out


def disagreement(te: TrainEngine, trajs) -> tuple[float, float]:
    """Share of response tokens (and of token x layer) whose position's expert set differs between
    the trainer's own routers and vLLM's."""
    tokens = differ = cells = cells_differ = 0
    for t in trajs:
        prompt = [int(x) for x in t.spec.prompt_tokens]
        with te.forwards.autocast():  # the trainer's compute dtype, as its logprob pass runs
            own = hf_routing(te.models.model, prompt + [int(x) for x in t.response_tokens])
        a = np.sort(own, -1)[len(prompt) - 1:]
        b = np.sort(np.asarray(t.routing), -1)[len(prompt) - 1:len(own)]
        layer = (a != b).any(-1)
        tokens, differ = tokens + len(layer), differ + int(layer.any(-1).sum())
        cells, cells_differ = cells + layer.size, cells_differ + int(layer.sum())
    return differ / max(tokens, 1), cells_differ / max(cells, 1)


def measure(te: TrainEngine, groups, moe: bool) -> dict:
    trajs = [t for g in groups for t in g]
    out = {"tokens": sum(len(t.response_tokens) for t in trajs)}
    for replay in ((False, True) if moe else (False,)):
        lps = trainer_logprobs(te, trajs, replay)
        d = np.concatenate([np.abs(lp - t.logprobs) for lp, t in zip(lps, trajs, strict=True)]).astype(np.float64)
        key = ("replay" if replay else "noreplay") if moe else "dense"
        out[f"mismatch_mean_{key}"] = float(d.mean())
        out[f"mismatch_p99_{key}"] = float(percentile(d.tolist(), 99))
    if moe:
        out["topk_disagree_noreplay"], out["topk_disagree_layer_noreplay"] = disagreement(te, trajs)
        rows = sum(len(t.routing) for t in trajs)
        out["routing_bytes_per_token"] = sum(t.routing.nbytes for t in trajs) / rows
        out["routing_bytes_per_trajectory"] = sum(t.routing.nbytes for t in trajs) / len(trajs)
    return out


async def run_model(model_dir: str, moe: bool, a, tmp: Path) -> dict:
    engine = VllmEngine(model_dir, max_model_len=512, max_num_seqs=64, kv_cache_gib=1, temperature=1.0, top_p=1.0,
                        seeded=True, routing=moe, dtype=a.dtype)
    te = TrainEngine(TrainerConfig(model_dir=model_dir, optimizer={"lr": a.lr}, groups_per_batch=a.prompts,
                                   minibatch_steps=2, logging={"mismatch_previous_version": False},
                                   moe={"routing_replay": moe}, performance={"dtype": a.dtype}),
                     a.seed, torch.device("cpu"))
    te.load()
    await engine.start()
    try:
        groups = await sample(engine, specs(a.prompts, a.group, a.max_tokens, "m0"), 0, a.seed)
        before = measure(te, groups, moe)
        rewards = []
        for v in range(a.versions):
            groups = await sample(engine, specs(a.prompts, a.group, a.max_tokens, f"t{v}"), v, a.seed + v + 1)
            rewards.append(float(np.mean([t.reward for g in groups for t in g])))
            te.train(groups, v + 1)
            torch.save(te.full_state()["model"], tmp / "w.pt")
            await engine.load_file(str(tmp / "w.pt"))
            print(f"  {'moe' if moe else 'dense'} version {v + 1}: reward {rewards[-1]:.3f}", flush=True)
        groups = await sample(engine, specs(a.prompts, a.group, a.max_tokens, "m1"), a.versions, a.seed + 999)
        after = measure(te, groups, moe) if a.versions else None
    finally:
        await engine.close()
    return {"before": before, "after": after, "reward_per_version": rewards}


def model_dir(given: str | None, moe: bool, tmp: Path, seed: int) -> tuple[str, str]:
    if given:
        return given, given
    build = build_tiny_moe_model if moe else build_tiny_model
    return str(build(tmp / ("moe" if moe else "dense"), seed=seed)), "random (built here, init std 0.02)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--moe-model", default="models/tiny-moe" if Path("models/tiny-moe/config.json").exists() else None)
    ap.add_argument("--dense-model", default="models/tiny" if Path("models/tiny/config.json").exists() else None)
    ap.add_argument("--prompts", type=int, default=8, help="groups sampled per measurement and per version")
    ap.add_argument("--group", type=int, default=4, help="responses per prompt")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--versions", type=int, default=20, help="training versions before the second measurement")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the engine's dtype and the trainer's compute dtype (bfloat16: autocast, fp32 master weights)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    exit_on_signals()
    torch.manual_seed(a.seed)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        moe_dir, moe_what = model_dir(a.moe_model, True, tmp, a.seed)
        dense_dir, dense_what = model_dir(a.dense_model, False, tmp, a.seed)
        dense = asyncio.run(run_model(dense_dir, False, a, tmp))
        moe = asyncio.run(run_model(moe_dir, True, a, tmp))
    rows = []
    for when in ("before", "after"):
        m, dn = moe[when], dense[when]
        if m is None:
            continue
        label = "start" if when == "before" else f"after {a.versions} versions"
        rows += [[label, "dense (no routing)", dn["mismatch_mean_dense"], dn["mismatch_p99_dense"], "-"],
                 [label, "MoE, own top-k", m["mismatch_mean_noreplay"], m["mismatch_p99_noreplay"],
                  m["topk_disagree_noreplay"]],
                 [label, "MoE, routing replay", m["mismatch_mean_replay"], m["mismatch_p99_replay"], "(replayed)"]]
    print_table(f"train-inference |dlogprob| per token, {a.dtype} (MoE: {moe_what}; dense: {dense_what})",
                ["weights", "trainer", "mean", "p99", "top-k differs (tokens)"], rows)
    b = moe["before"]
    print(f"routing: {b['routing_bytes_per_token']:.1f} bytes per token, "
          f"{b['routing_bytes_per_trajectory']:.0f} per trajectory")
    out = {**{k: v for k, v in b.items() if k != "tokens"}, "tokens": b["tokens"],
           "dense_mismatch_mean": dense["before"]["mismatch_mean_dense"],
           "dense_mismatch_p99": dense["before"]["mismatch_p99_dense"],
           "after_versions": {**(moe["after"] or {}), **{f"dense_{k}": v for k, v in (dense["after"] or {}).items()}},
           "versions": a.versions, "reward_per_version_moe": moe["reward_per_version"],
           "reward_per_version_dense": dense["reward_per_version"], "moe_model": moe_what, "dense_model": dense_what,
           "dtype": a.dtype}
    write_json(a.out, out)


if __name__ == "__main__":
    main()
