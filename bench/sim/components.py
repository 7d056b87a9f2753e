"""Component checks: one mechanism of the simulator at a time against a component figure of the
paper (paper.json `components`), never an end-to-end throughput.

    rows = component_checks(setup, workload)              # fig9, fig14, fig18 (seconds of CPU)
    rows.update(fig16_rows(laminar_run, norepack_run, workload))   # from two cluster runs

Each row is {sim, paper, rel_error} (+ what it is, and whether a constant was calibrated on it):
- fig9_batch_s, fig9_tail_s: the single-replica timeline of Fig. 9 replayed on one SimEngine
  (32B, TP 4, 512 trajectories = 32 prompts × 16, all submitted at once, virtual clock): the
  time until the last trajectory ends, and how long the phase with fewer than 5 sequences
  running (or waiting) lasts. The host time per step (latency.HOST_MS_PER_LAYER) was calibrated
  on the tail, the host time per running sequence (paper.yaml rollout.host_ms_per_seq) on the
  batch time; Fig. 16 checks both.
- fig14_wait_s: the one_step/stream rollouts' wait per global NCCL weight sync, as the simulator
  charges it (trainer_cost.NcclBroadcast), against Fig. 14's 32B line (its 72B line calibrated
  the model; both are listed under `points`). The mean over the five rollout GPU counts.
- fig18_relay_s: the relay chain's broadcast time (trainer_cost.broadcast_s) against the paper's
  relay latency by machines, mean over both models and six machine counts (the link's bandwidth
  and per-chunk overhead in configs/sim/paper.yaml were calibrated on these points).
- fig16_gen_with_repack, fig16_gen_without_repack: generation tokens/s of 16 rollouts of 32B on
  128 GPUs, laminar with and without repack (two cluster runs of the sweep).

Beside the rows, `repack_window`: what bounds repack's gain on one replica (docs/sim.md).
"""
from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from laminar.roles.rollout.sim_engine import SimEngine, VirtualClock

from bench.sim.calibrate import PaceCache, pace_cache_path
from bench.sim.processes import execute
from bench.sim.report import _f, _shown
from bench.sim.runs import engine_settings, run_spec
from laminar.report import print_table, write_json
from laminar.sim.hardware import model as model_shape
from laminar.sim.scenario import engine_curve, estimate, mode_tp
from laminar.sim.setup import SimSetup
from laminar.sim.trainer_cost import NcclBroadcast, RelayLink, broadcast_s
from laminar.stepcurve import roofline_batch_bound

COMPONENT_RUNS = {"warmup": 2, "measure": 2}  # the Fig. 16 runs: 32B/128, laminar with and without repack


def _row(sim: float, paper: float, **extra) -> dict:
    return {"sim": round(sim, 3), "paper": round(paper, 3), "rel_error": round(sim / paper - 1, 3), **extra}


def _replica_32b(setup: SimSetup, clock) -> SimEngine:
    """One 32B replica as paper.yaml configures the rollouts (TP, lengths, memory, host time); no
    scoring cost: the paper's Fig. 9 and 16 are the engine's timeline alone."""
    shape, m, rs = setup.run_shape, setup.model_setup("32B"), setup.rollout
    kw = {} if rs.host_ms_per_layer is None else {"host_ms_per_layer": rs.host_ms_per_layer}
    if rs.host_ms_per_seq:
        kw["host_ms_per_seq"] = rs.host_ms_per_seq
    return SimEngine.from_workload(model="32B", tp=m.tp, lengths=m.lengths, gpu=setup.gpu,
                                   max_num_seqs=shape.max_concurrency, mem_fraction=rs.mem_fraction,
                                   max_output_tokens=shape.max_output_tokens,
                                   max_model_len=shape.max_input_tokens + shape.max_output_tokens,
                                   emit_every=16, context_dependence=rs.context_dependence,
                                   workload_path=setup.workload, clock=clock, **kw)


def fig9_replay(setup: SimSetup, workload: dict) -> dict:
    """One 32B TP4 replica running 512 trajectories from t = 0 (module docstring)."""
    shape = setup.run_shape
    trace: list[tuple[float, int]] = []

    class Recording(VirtualClock):
        engine = None

        async def sleep(self, seconds: float) -> None:
            await super().sleep(seconds)
            trace.append((self.t, len(self.engine.running) + len(self.engine.waiting)))

    async def main() -> dict:
        clock = Recording()
        e = _replica_32b(setup, clock)
        clock.engine = e
        await e.start()

        async def one(i: int) -> None:
            prompt = [1000 + i // 16] * shape.prompt_tokens
            async for _ in e.generate(f"t{i}", prompt, shape.max_output_tokens, seed=i):
                pass
        await asyncio.gather(*(one(i) for i in range(512)))
        stats = e.sim_stats()
        await e.close()
        end = trace[-1][0]
        tail_from = next(t for t, n in trace if n < 5)
        return {"batch_s": end, "tail_from_s": tail_from, "tail_s": end - tail_from,
                "peak_kv_usage": stats["peak_kv_usage"], "preemptions": stats["preemptions"]}
    return asyncio.run(main())


def repack_window(setup: SimSetup, workload: dict, batch_bound: int, trajectories: int = 1024,
                  report_s: float | None = None) -> dict:
    """What bounds repack's gain on one 32B TP4 replica (Fig. 16's rollouts): a batch of
    `trajectories` (64 prompts × 16 at the paper's 1,024) submitted at once on the virtual clock,
    the manager's inputs sampled every report period (paper.yaml periods_sim_s.report). Returns
    how long the replica is a repack candidate by size (0 < running < B, nothing waiting), the
    share of the batch's tokens made then, the bound a perfect consolidation of that phase would
    give (its tokens at the bulk's rate), and how often the trend test holds in that phase, as the
    paper's listing has it (KV usage below the previous report's) and as the manager's default
    (below the batch's peak) — a plan needs it on source and destination at once."""
    shape = setup.run_shape
    period = float(report_s or setup.periods_sim_s.report)

    async def main() -> dict:
        clock = VirtualClock()
        e = _replica_32b(setup, clock)
        await e.start()
        samples: list[tuple[float, float, int, int, int]] = []
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                await clock.sleep(period)
                samples.append((clock.t, e.stats.kv_usage, len(e.running), len(e.waiting), e.counters["tokens"]))

        async def one(i: int) -> None:
            prompt = [1000 + i // 16] * shape.prompt_tokens
            async for _ in e.generate(f"t{i}", prompt, shape.max_output_tokens, seed=i):
                pass
        sampler = asyncio.create_task(sample())
        await asyncio.gather(*(one(i) for i in range(trajectories)))
        done.set()
        await sampler
        await e.close()
        return samples
    samples = asyncio.run(main())
    end, total = samples[-1][0], samples[-1][4]
    phase = [(t, kv, prev[1], tok) for prev, (t, kv, n, waiting, tok) in zip(samples, samples[1:], strict=False)
             if 0 < n < batch_bound and waiting == 0]
    if not phase:
        return {"batch_s": round(end, 1), "candidate_s": 0.0}
    t0 = phase[0][0]
    tok0 = next(tok for t, _, _, _, tok in samples if t == t0)
    bulk_rate, phase_rate = tok0 / t0, (total - tok0) / (end - t0)
    falling = sum(1 for _, kv, prev, _ in phase if kv < prev)
    below_peak, peak = 0, 0.0  # the manager's default trend: below the batch's peak (one batch, no admissions)
    in_phase = {p[0] for p in phase}
    for t, kv, _, _, _ in samples:
        below_peak += (kv < peak and t in in_phase)
        peak = max(peak, kv)
    ideal_end = t0 + (total - tok0) / bulk_rate
    return {"batch_bound": batch_bound, "trajectories": trajectories, "report_s": period,
            "batch_s": round(end, 1), "candidate_from_s": round(t0, 1), "candidate_s": round(end - t0, 1),
            "candidate_share_of_batch": round((end - t0) / end, 3),
            "tokens_share_in_candidate_phase": round((total - tok0) / total, 4),
            "bulk_tokens_per_s": round(bulk_rate), "candidate_tokens_per_s": round(phase_rate),
            "perfect_consolidation_gain": round(end / ideal_end - 1, 3),
            "reports_in_phase": len(phase), "reports_kv_falling": falling,
            "kv_falling_share": round(falling / len(phase), 3), "reports_below_peak": below_peak,
            "below_peak_share": round(below_peak / len(phase), 3)}


def component_checks(setup: SimSetup, workload: dict) -> dict:
    """The rows that need no cluster run: fig9_*, fig14_wait_s, fig18_relay_s."""
    comp, rs = workload["components"], setup.rollout
    f9 = comp["fig9_single_replica_32B_TP4_512_trajectories"]
    r = fig9_replay(setup, workload)
    paper_tail = f9["batch_ends_s"] - f9["fewer_than_5_running_from_s"]
    rows = {"fig9_batch_s": _row(r["batch_s"], f9["batch_ends_s"], calibrated=bool(rs.host_ms_per_seq),
                                 peak_kv_usage=round(r["peak_kv_usage"], 3), preemptions=r["preemptions"]),
            "fig9_tail_s": _row(r["tail_s"], paper_tail, calibrated=True, tail_from_s=round(r["tail_from_s"], 1),
                                paper_tail_from_s=f9["fewer_than_5_running_from_s"])}
    f14 = comp["fig14_rollout_wait_s_per_update"]
    nccl = NcclBroadcast() if setup.nccl is None else NcclBroadcast(setup.nccl.bandwidth_gbps,
                                                                    setup.nccl.per_doubling_gbps)
    points = {}
    for size in ("32B", "72B"):
        w = model_shape(size).weight_bytes()
        points[size] = [{"rollout_gpus": g, "sim": round(nccl.seconds(w, g), 3), "paper": p}
                        for g, p in zip(f14["rollout_gpus"], f14[f"{size}_global_nccl_sync"], strict=False)]
    check = points["32B"]
    rows["fig14_wait_s"] = _row(sum(p["sim"] for p in check) / len(check), sum(p["paper"] for p in check) / len(check),
                                calibrated=False, line="32B (the 72B line calibrated the model)",
                                worst_point_rel_error=round(max(abs(p["sim"] / p["paper"] - 1) for p in check), 3),
                                points=points)
    rl = setup.relay
    link = RelayLink(rl.bandwidth_gbps, rl.chunk_mib, rl.alpha_s)
    rt = workload["relay_broadcast_latency_s_by_machines"]
    pts = [{"model": size, "machines": p, "sim": round(broadcast_s(model_shape(size).weight_bytes(), p, link), 3),
            "paper": t} for size in ("32B", "72B") for p, t in zip(rt["machines"], rt[size], strict=False)]
    rows["fig18_relay_s"] = _row(sum(p["sim"] for p in pts) / len(pts), sum(p["paper"] for p in pts) / len(pts),
                                 calibrated=True,
                                 worst_point_rel_error=round(max(abs(p["sim"] / p["paper"] - 1) for p in pts), 3),
                                 points=pts)
    return rows


def fig16_rows(with_repack: dict | None, without_repack: dict | None, workload: dict) -> dict:
    """Generation tokens/s of the two cluster runs (harness results) against Fig. 16."""
    f16 = workload["components"]["fig16_generation_tokens_per_s_32B_128_gpus_16_rollouts"]
    rows = {}
    for key, run, paper in (("fig16_gen_with_repack", with_repack, f16["with_repack"]),
                            ("fig16_gen_without_repack", without_repack, f16["without_repack"])):
        g = (run or {}).get("generation_tokens_per_s")
        rows[key] = _row(g, paper, calibrated=False, kv_usage_mean=(run or {}).get("kv_usage_mean")) if g else \
            {"sim": None, "paper": paper, "rel_error": None, "error": (run or {}).get("error", "no measurement")}
    return rows


def components(setup: SimSetup, workload: dict, a) -> int:
    """`bench/scale.py --components`: the rows above, the Fig. 16 pair run as two child processes
    (`a.jobs` at a time, rerun slower if they lag, as a sweep's runs are), printed and written."""
    t0 = time.monotonic()
    rows = component_checks(setup, workload)
    print(f"[{time.strftime('%H:%M:%S')}] fig9 replay, fig14, fig18 done ({time.monotonic() - t0:.0f} s)", flush=True)
    b = roofline_batch_bound(engine_curve(setup, workload, "32B", mode_tp(setup, "32B", "laminar")),
                             setup.manager.roofline_tolerance)
    window = repack_window(setup, workload, b)
    print(f"  repack window (one 32B TP4 replica, {window['trajectories']} trajectories, B = {b}): a size candidate "
          f"for {window['candidate_s']:.0f} of {window['batch_s']:.0f} s, making "
          f"{window['tokens_share_in_candidate_phase']:.1%} of its tokens; perfect consolidation would give "
          f"+{window['perfect_consolidation_gain']:.0%}; KV falling report to report in "
          f"{window['reports_kv_falling']}/{window['reports_in_phase']} reports of that phase, below the "
          f"batch's peak in {window['reports_below_peak']}", flush=True)
    root = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="laminar-components-", dir="/dev/shm"))
    root.mkdir(parents=True, exist_ok=True)
    specs = [run_spec(a, setup, estimate(setup, workload, "32B", 128, mode), "32B", 128, mode,
                      a.warmup or COMPONENT_RUNS["warmup"], a.measure or COMPONENT_RUNS["measure"], root)
             for mode in ("laminar", "laminar_norepack")]
    try:
        results = execute(specs, a.jobs, root, keep=bool(a.workdir), cache=PaceCache(pace_cache_path(a)))
    finally:
        if not a.workdir:
            shutil.rmtree(root, ignore_errors=True)
    runs = {m: results.get(("32B", 128, m)) for m in ("laminar", "laminar_norepack")}
    valid = {m: r if r and not r.get("lagged") and r.get("finished") else
             {"error": "lagged" if r and r.get("lagged") else (r or {}).get("error", "unfinished")}
             for m, r in runs.items()}  # a lagging run's generation understates the model: no row from it
    rows.update(fig16_rows(valid["laminar"], valid["laminar_norepack"], workload))
    print_table("component checks (simulated vs the paper's component figures; rel_error = sim / paper - 1)",
                ["component", "sim", "paper", "rel_error", "calibrated on it"],
                [[k, _f(r["sim"], 3), r["paper"], "-" if r["rel_error"] is None else f"{r['rel_error']:+.1%}",
                  "yes" if r.get("calibrated") else "no"] for k, r in rows.items()])
    write_json(a.out, {"components": rows, "repack_window": window, "setups": _shown(a.setups), "fig16_runs": runs,
                       **engine_settings(setup), "wall_s": round(time.monotonic() - t0, 1)})
    print(f"total wall time {time.monotonic() - t0:.0f} s")
    return 0
