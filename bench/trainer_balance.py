"""`bench/trainer.py --balance`: how evenly the trainer's ranks are loaded on the paper's response
lengths, sequences dealt round-robin by count (the trainer before balancing) against the balanced
token-budget plan (roles/trainer/micro_batches.py), at 8 and 32 data-parallel ranks.

Lengths: the 7B and 32B math distributions fitted to the paper's statistics (laminar/sim/lengths.py,
configs/workloads/paper.json; capped at the run's 16,384 output tokens), plus a prompt of
`--prompt` tokens each (the paper gives no prompt statistics; a constant only dampens imbalance).
A mini-batch is the paper's: 8,192 sequences a global batch in 16 mini-batch steps, 512 sequences.
Round robin: micro-batches of `--micro` sequences; balanced: `--max-tokens` per micro-batch, packed.

Per plan: `rank_imbalance` = max / mean of the ranks' tokens (what the trainer logs), and the
lockstep cost = the sum over micro-batch rounds of the largest micro-batch (every FSDP2 layer is a
meeting point, so the slowest rank sets each round's time), over the same for a perfect split
(total tokens / ranks). Means over `--batches` mini-batches. Tokens stand for time here; attention
makes a long sequence cost more than its tokens, which `micro_batch_balance: attention` weighs.
"""
from __future__ import annotations

import numpy as np
from laminar.roles.trainer.micro_batches import plan_micro_batches

from laminar.sim.lengths import workload_lengths  # the benchmark reads the workload's distribution

MINI_BATCH = 8192 // 16


def lockstep(plan, world: int) -> float:
    rounds = list(zip(*plan.tokens, strict=True))
    total = sum(sum(r) for r in rounds)
    return sum(max(r) for r in rounds) / (total / world) if total else 1.0


def measure(workload: str, world: int, batches: int, prompt: int, micro: int, max_tokens: int) -> dict:
    dist = workload_lengths(workload)
    rng = np.random.default_rng(0)
    acc: dict[str, list[float]] = {k: [] for k in ("rr", "bal", "rr_lockstep", "bal_lockstep", "bal_micro")}
    for _ in range(batches):
        lengths = [int(x) + prompt for x in dist.sample(rng, MINI_BATCH)]
        idx = list(range(MINI_BATCH))
        rr = plan_micro_batches(idx, lengths, world, micro, balance="round_robin")
        bal = plan_micro_batches(idx, lengths, world, MINI_BATCH, max_tokens, balance="tokens")
        acc["rr"].append(rr.rank_imbalance())
        acc["bal"].append(bal.rank_imbalance())
        acc["rr_lockstep"].append(lockstep(rr, world))
        acc["bal_lockstep"].append(lockstep(bal, world))
        acc["bal_micro"].append(len(bal.ranks[0]))
    m = {k: float(np.mean(v)) for k, v in acc.items()}
    return {"workload": workload, "ranks": world, "rank_imbalance_round_robin": m["rr"],
            "rank_imbalance_balanced": m["bal"], "lockstep_round_robin": m["rr_lockstep"],
            "lockstep_balanced": m["bal_lockstep"], "micro_batches_balanced": m["bal_micro"],
            "micro_batches_round_robin": float(len(rr.ranks[0])),
            "lockstep_time_ratio": m["bal_lockstep"] / m["rr_lockstep"]}


def main_balance(a) -> dict:
    rows = [measure(w, r, a.batches, a.prompt, a.micro, a.max_tokens)
            for w in ("7B_math", "32B_math") for r in (8, 32)]
    print(f"ranks' tokens on the paper's lengths: mini-batches of {MINI_BATCH}, prompt {a.prompt} tokens, "
          f"round robin by {a.micro} sequences vs balanced {a.max_tokens:,}-token micro-batches (mean of "
          f"{a.batches} mini-batches)")
    print(f"  {'lengths':<10}{'ranks':>6}{'imbalance rr':>14}{'balanced':>10}{'lockstep rr':>13}{'balanced':>10}"
          f"{'time ratio':>12}{'micro-batches':>15}")
    for x in rows:
        print(f"  {x['workload']:<10}{x['ranks']:>6}{x['rank_imbalance_round_robin']:>14.3f}"
              f"{x['rank_imbalance_balanced']:>10.3f}{x['lockstep_round_robin']:>13.3f}{x['lockstep_balanced']:>10.3f}"
              f"{x['lockstep_time_ratio']:>12.3f}{x['micro_batches_balanced']:>15.1f}")
    key = next(x for x in rows if x["workload"] == "32B_math" and x["ranks"] == 32)
    return {"rows": rows, "prompt_tokens": a.prompt, "micro_batch_size_round_robin": a.micro,
            "max_tokens_per_micro_batch": a.max_tokens, "mini_batch": MINI_BATCH,
            "rank_imbalance_round_robin": key["rank_imbalance_round_robin"],
            "rank_imbalance_balanced": key["rank_imbalance_balanced"],
            "lockstep_time_ratio": key["lockstep_time_ratio"]}
