"""The difficulty curriculum on a synthetic prompt set: how many of the groups handed out carry a
GRPO signal (their samples neither all right nor all wrong), with the curriculum off and on.

The real prompt pool (in-process bus, SQLite store) hands out groups one TakeBatch at a time; a
synthetic policy answers them: prompt i is solved by each sample with a fixed probability p_i,
drawn once from a mix of easy (p = 1), hard (p = 0) and in-between prompts (`--easy`, `--hard`
shares), and every group's result goes back as GroupResults, as the experience buffer sends them.
Nothing learns, so this measures the curriculum's selection alone: the share of informative
groups among those generated, i.e. how much generation dynamic sampling would throw away.

    python bench/curriculum.py --groups 2000 --out runs/bench/curriculum.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

import numpy as np

from laminar.config import parse_config
from laminar.protocol import GroupResults, TakeBatch
from laminar.report import print_table, write_json
from laminar.testing.inproc_cluster import InprocCluster


def difficulties(n: int, easy: float, hard: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, size=n, p=[easy, hard, 1 - easy - hard])
    return np.where(kind == 0, 1.0, np.where(kind == 1, 0.0, rng.uniform(0.05, 0.95, n)))


async def run(tmp: Path, curriculum: dict | None, p: np.ndarray, groups: int, n: int, seed: int) -> dict:
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "x"}) + "\n" for i in range(len(p))))
    pool = {"dataset": str(data), "group_size": n, "seed": seed, **({"curriculum": curriculum} if curriculum else {})}
    cfg = parse_config({"run": {"workdir": str(tmp), "name": "bench-curriculum"},
                        "cluster": {"keys_dir": None, "broker": {"host": "h0"}, "hosts": {"h0": {
                            "address": "127.0.0.1", "roles": [{"role": "prompt_pool", "port": 6791}]}}},
                        "roles": {"prompt_pool": pool}})
    cl = InprocCluster(cfg)
    role = await cl.start("prompt_pool")
    pp = cl.client("prompt_pool")
    rng = np.random.default_rng(seed + 1)
    informative = 0
    for _ in range(groups):
        b = await pp.call(TakeBatch("bench", n))
        gid = b.trajectories[0].group_id
        solved = int(rng.binomial(n, p[int(b.trajectories[0].prompt_id)]))
        informative += 0 < solved < n
        await pp.call(GroupResults([gid], [solved], [n]))
    counts = role.counts()
    mid = [str(i) for i in range(len(p)) if 0 < p[i] < 1]  # prompts that can still teach something
    cur = role.curriculum
    await cl.close()
    return {"groups": groups, "informative": informative, "share": informative / groups,
            "epochs": counts["epoch"], **{k: v for k, v in counts.items() if k.startswith("curriculum")},
            "mid_prompts_retired": sum(cur.state(i) == "solved" for i in mid) if cur else 0,
            "mid_prompts_downweighted": sum(cur.state(i) == "unsolved" for i in mid) if cur else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--groups", type=int, default=2000, help="groups handed out per setting")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--easy", type=float, default=0.4, help="share of prompts every sample solves")
    ap.add_argument("--hard", type=float, default=0.3, help="share of prompts no sample solves")
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--unsolved-weight", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the results as JSON here")
    a = ap.parse_args()
    p = difficulties(a.prompts, a.easy, a.hard, a.seed)
    print(f"prompts: {(p == 1).sum()} always solved, {(p == 0).sum()} never, {((p > 0) & (p < 1)).sum()} in between")
    settings = {"off": None, "on": {"window": a.window, "unsolved_weight": a.unsolved_weight}}
    results = {}
    for name, cur in settings.items():
        with tempfile.TemporaryDirectory() as tmp:
            results[name] = asyncio.run(run(Path(tmp), cur, p, a.groups, a.group_size, a.seed))
    print_table(f"curriculum: {a.prompts} prompts ({a.easy:.0%} always solved, {a.hard:.0%} never), "
                f"groups of {a.group_size}, {a.groups} groups handed out",
                ["curriculum", "informative groups", "share", "epochs", "retired (in-between)",
                 "down-weighted (in-between)"],
                [[k, r["informative"], r["share"], r["epochs"],
                  f"{r.get('curriculum_retired', 0)} ({r['mid_prompts_retired']})",
                  f"{r.get('curriculum_downweighted', 0)} ({r['mid_prompts_downweighted']})"]
                 for k, r in results.items()])
    write_json(a.out, {"settings": vars(a), "results": results})


if __name__ == "__main__":
    main()
