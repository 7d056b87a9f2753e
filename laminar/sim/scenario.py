"""Scale scenarios: one of the paper's setups (model, GPU count, mode) as a runnable LaminarConfig.

    setup = load_setup("configs/sim/paper.yaml")       # SimSetup (laminar/sim/setup.py)
    raw = build_config(setup, "72B", 1024, "laminar", workdir="runs/sim/72B-1024-laminar", speedup=3,
                       iterations=10, workload=load_workload(), weights_root="/dev/shm/sim-72B")
    write_prompts(raw, setup, 8192)                     # the synthetic prompts it reads
    est = estimate(setup, workload, "72B", 1024, "laminar")   # expected iteration time, speedup

What a scenario is made of (everything else is the real roles' code):
- placement: `[train GPUs, rollout GPUs]` from the workload file (paper.json) — the laminar
  placement for laminar / laminar_norepack, the one_step-and-stream placement for those two; sync
  is colocated: every GPU generates, then every GPU trains (trainer GPUs = all GPUs, rollout
  replicas = all GPUs ÷ TP, and the barrier keeps the rollouts idle while the trainer runs);
- hosts of `gpus_per_host` GPUs: `rollout GPUs ÷ TP` replicas, `gpus_per_host ÷ TP` per host,
  one weight folder per host (its relay's shared memory, real relay or modeled delivery);
- trajectories a rollout takes per batch: `max_concurrency` (the paper's 1,024) in the laminar
  modes; in the barrier modes the global batch split evenly over the replicas (at most that), as
  verl does — otherwise the first replicas to ask would take the whole batch and the rest idle;
- the control host: manager, prompt pool, partial pool, experience buffer, trainer;
- the roles' periods are given in simulated seconds and divided by the speedup, with real-time
  floors where a shorter period would only burn CPU (documented in configs/sim/paper.yaml);
- a synthetic prompt set: `prompt_tokens` tokens per prompt (byte tokenizer), each prompt unique
  so a GRPO group shares a prefix-cache entry and different groups do not;
- scoring each response (paper.yaml `reward`, measured by length): in the sim trainer's terms for
  the modes whose real counterpart scores in a single controller (`controller.modes`), in the
  rollouts' sim engine settings for the others (laminar scores inline in its rollouts).

Nothing here reads a throughput figure of the paper: the workload file supplies placements, TP,
step curves and length statistics (inputs), and bench/scale.py shows the paper's throughput
numbers only beside ours.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from laminar.sim.hardware import gpu as gpu_spec
from laminar.sim.hardware import kv_capacity_tokens
from laminar.sim.hardware import model as model_shape
from laminar.sim.latency import HOST_MS_PER_LAYER, decode_step_ms, kv_ms_per_token, model_curve
from laminar.sim.lengths import workload_lengths
from laminar.sim.reward_cost import RewardCost
from laminar.sim.setup import BARRIER_MODES, MODES, SimSetup
from laminar.sim.trainer_cost import NcclBroadcast, TrainerCost, colocated_switch_s
from laminar.stepcurve import StepCurve, roofline_batch_bound

_PORT0 = 20000


def wave_versions(setup: SimSetup, workload: dict, size: str, gpus: int) -> int:
    """Global batches the laminar rollouts hold at once (replicas × max_concurrency ÷ global
    batch, rounded up). Every rollout's first batch starts together, so laminar's updates come in
    waves of this many versions (at 72B/1,024: 4), and they stay in step."""
    shape = setup.run_shape
    replicas = placement(workload, size, gpus, "laminar")[1] // mode_tp(setup, size, "laminar")
    batch = shape.prompts_per_batch * shape.group_size
    return max(1, math.ceil(replicas * shape.max_concurrency / batch))


def measured_versions(measure: int, wave: int) -> int:
    """The versions a laminar run measures: `measure` rounded down to whole waves of updates, at
    least one wave. A window of part of a wave over- or understates the steady state; whole waves
    are each as long as the next (at 72B/1,024 the first of two waves' mean iteration came within
    0.2-1.6% of both's in four runs: docs/sim.md, "Versions"), so one wave is measured where more
    would only lengthen the run."""
    return max(1, measure // wave) * wave


def mode_tp(setup: SimSetup, size: str, mode: str) -> int:
    """The rollout TP of a mode: the model's `tp`, or its `baseline_tp` in the barrier modes (the
    paper ran its 7B baselines at TP 2 and laminar at TP 1)."""
    m = setup.model_setup(size)
    return (m.baseline_tp or m.tp) if mode in BARRIER_MODES else m.tp


def scores_in_driver(setup: SimSetup, mode: str) -> bool:
    """Whether a mode's real counterpart scores its responses in a single controller (paper.yaml
    `controller.modes`: verl's driver) rather than in its rollouts (laminar)."""
    return setup.controller is not None and mode in setup.controller.modes


def reward_points(setup: SimSetup) -> list[list[float]] | None:
    """paper.yaml `reward.s_by_response_tokens` as [[tokens, seconds], ...] (None: scoring is free)."""
    return None if setup.reward is None else [[float(n), float(s)] for n, s in setup.reward.s_by_response_tokens]


def trainer_terms(setup: SimSetup, workload: dict, size: str, gpus: int, mode: str) -> dict:
    """The sim trainer's cost terms of a mode (configs/sim/paper.yaml `trainer`, `controller`,
    `reward`, `colocated`, `weight_sync`; derivations there and in laminar/sim/trainer_cost.py):
    FSDP and SP sizes, the old-logprob pass, the single controller (the modes that score in a
    driver: every response's scoring, one after another, and the batch's moves), the colocated
    phase switches (sync), and the blocking NCCL broadcast (where `weight_sync` says nccl)."""
    ts, m = setup.trainer, setup.model_setup(size)
    train_gpus, roll_gpus = placement(workload, size, gpus, mode)
    out = {"fsdp": m.fsdp, "sp": m.sp, "optimizer_steps": ts.optimizer_steps,
           "collective_gbps": ts.collective_gbps, "balance": ts.balance, "attention": ts.attention}
    if scores_in_driver(setup, mode):
        ctl, shape = setup.controller, setup.run_shape
        positions = shape.max_input_tokens + shape.max_output_tokens
        out["controller_s_per_trajectory"] = ctl.moves * positions * ctl.bytes_per_position / (ctl.gbps * 1e9)
        if (points := reward_points(setup)) is not None:
            out["reward_s_by_tokens"] = points
    if setup.colocated is not None and mode == "sync":
        col = setup.colocated
        out["switch_s"] = colocated_switch_s(model_shape(size), mode_tp(setup, size, mode), out["fsdp"] or 1,
                                             out["collective_gbps"], col.pcie_gbps, col.state_bytes_per_param)
    sync = setup.weight_sync.get(mode, "relay")
    if sync == "colocated":
        out["colocated"] = True
    if sync == "nccl":
        if setup.nccl is None:
            raise ValueError(f"sim setup: weight_sync.{mode} is nccl but the file has no `nccl` section")
        out["nccl"] = {"bandwidth_gbps": setup.nccl.bandwidth_gbps, "per_doubling_gbps": setup.nccl.per_doubling_gbps,
                       "rollout_gpus": roll_gpus}
    return out


def old_logprobs(setup: SimSetup, mode: str) -> str:
    """behaviour or recompute (the trainer role's old_logprobs): paper.yaml trainer.old_logprobs."""
    return setup.trainer.old_logprobs.get(mode, "behaviour")


def placement(workload: dict, size: str, gpus: int, mode: str) -> tuple[int, int]:
    """(train GPUs, rollout GPUs) of a mode at a scale (sync: colocated, both = all GPUs)."""
    if mode == "sync":
        return gpus, gpus
    key = ("placements_train_rollout_gpus_laminar" if mode.startswith("laminar")
           else "placements_train_rollout_gpus_one_step_and_stream")
    table = workload[key][size]
    if str(gpus) not in table:
        raise KeyError(f"no {mode} placement for {size} at {gpus} GPUs; known: {sorted(table, key=int)}")
    train, roll = table[str(gpus)]
    return int(train), int(roll)


def scales(workload: dict, size: str) -> list[int]:
    """GPU counts with a placement for every mode."""
    a = set(workload["placements_train_rollout_gpus_laminar"][size])
    b = set(workload["placements_train_rollout_gpus_one_step_and_stream"][size])
    return sorted(int(g) for g in a & b)


def period(setup: SimSetup, name: str, speedup: float) -> float:
    """A role period in real seconds: the simulated period ÷ speedup, at least its real floor."""
    return max(getattr(setup.periods_sim_s, name) / speedup, getattr(setup.real_floor_s, name))


def run_mode_of(mode: str) -> str:
    """The cluster's run mode of a sim mode (laminar_unbounded is laminar without the bound)."""
    return "laminar" if mode == "laminar_unbounded" else mode


def staleness_bound(setup: SimSetup, mode: str, ahead: int | None | str = "setup",
                    max_staleness: int | None | str = "setup") -> tuple[int | None, int | None]:
    """(max_batches_ahead, max_staleness) of a run: paper.yaml `staleness` for laminar and
    laminar_norepack unless given ("setup": the file's); none for laminar_unbounded (the paper's
    setting) and the barrier modes (their gate and buffer bound come from the mode itself)."""
    if mode not in ("laminar", "laminar_norepack"):
        return None, None
    st = setup.staleness
    return (st.ahead if ahead == "setup" else ahead), (st.max if max_staleness == "setup" else max_staleness)


def build_config(setup: SimSetup, size: str, gpus: int, mode: str, *, workdir: str, speedup: float,
                 iterations: int, workload: dict, weights_root: str, relays: bool = False,
                 name: str | None = None, ahead: int | None = None, max_staleness: int | None = None) -> dict:
    """The LaminarConfig (as a dict) of one scenario. `weights_root`: folder under which each
    rollout host gets its weight folder (shared memory, e.g. /dev/shm/laminar-sim-<tag>).
    `ahead`, `max_staleness`: the prompt pool's max_batches_ahead and the experience buffer's
    max_staleness in the laminar modes (None: no bound, the paper's; `staleness_bound` gives
    paper.yaml's defaults)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {MODES}")
    m = setup.model_setup(size)
    shape = setup.run_shape
    tp, per_host = mode_tp(setup, size, mode), setup.gpus_per_host
    train_gpus, roll_gpus = placement(workload, size, gpus, mode)
    replicas = roll_gpus // tp
    if replicas < 1 or per_host % tp:
        raise ValueError(f"{size} at TP={tp}: {roll_gpus} rollout GPUs on hosts of {per_host} GPUs")
    per_host_replicas = per_host // tp
    n_hosts = math.ceil(replicas / per_host_replicas)
    hosts_dirs = {f"n{h}": f"{weights_root}/n{h}" for h in range(n_hosts)}
    port = iter(range(_PORT0, _PORT0 + 10_000))

    ctl_roles = [{"role": "manager", "port": next(port)}, {"role": "prompt_pool", "port": next(port)},
                 {"role": "partial_pool", "port": next(port)}, {"role": "experience_buffer", "port": next(port)},
                 {"role": "trainer"}]
    hosts = {"ctl": {"address": "127.0.0.1", "roles": ctl_roles}}
    for h in range(n_hosts):
        roles = []
        if relays:
            roles.append({"role": "relay", "id": f"r{h}", "port": next(port),
                          "options": {"shm_dir": hosts_dirs[f"n{h}"]}})
        for k in range(per_host_replicas):
            i = h * per_host_replicas + k
            if i >= replicas:
                break
            opts = {"relay_id": f"r{h}"} if relays else {"shm_dir": hosts_dirs[f"n{h}"]}
            roles.append({"role": "rollout", "id": str(i), "port": next(port), "options": opts})
        hosts[f"n{h}"] = {"address": "127.0.0.1", "roles": roles}

    concurrency = shape.max_concurrency
    if mode in BARRIER_MODES:  # a barrier splits the global batch evenly (verl)
        concurrency = min(concurrency, shape.group_size * math.ceil(shape.prompts_per_batch / replicas))
    curve_b = roofline_batch_bound(engine_curve(setup, workload, size, tp), setup.manager.roofline_tolerance)
    rs, ts = setup.rollout, setup.trainer
    terms = trainer_terms(setup, workload, size, gpus, mode)
    mem = rs.mem_fraction_colocated if mode == "sync" else rs.mem_fraction
    rollout_sim = {"model": size, "tp": tp, "lengths": m.lengths, "gpu": setup.gpu, "speedup": speedup,
                   "mem_fraction": mem, "emit_every": m.emit_every or rs.emit_every, "load_gbps": rs.load_gbps,
                   "context_dependence": rs.context_dependence, "stream_batch": rs.stream_batch,
                   "max_output_tokens": shape.max_output_tokens, "group_correlation": rs.group_correlation}
    if rs.host_ms_per_layer is not None:
        rollout_sim["host_ms_per_layer"] = rs.host_ms_per_layer
    if rs.host_ms_per_seq:
        rollout_sim["host_ms_per_seq"] = rs.host_ms_per_seq
    if not scores_in_driver(setup, mode) and (points := reward_points(setup)) is not None:
        rollout_sim["reward_s_by_tokens"] = points  # laminar: each rollout scores its own, inline
    if m.curve_path:  # a measured step curve (bench/step_curve.py's JSON) instead of the paper's
        rollout_sim["curve_path"] = str(m.curve_path)
    if terms.get("colocated"):  # resharded in place: the engine's wake is in the trainer's switch_s
        rollout_sim["load_s"] = 0.0
    if "nccl" in terms:  # a blocking broadcast: the rollouts wait it out as they take the version
        n = terms["nccl"]
        rollout_sim["load_s"] = NcclBroadcast(n["bandwidth_gbps"], n["per_doubling_gbps"]).seconds(
            model_shape(size).weight_bytes(), n["rollout_gpus"])
    if setup.workload:
        rollout_sim["workload_path"] = str(setup.workload)
    trainer_sim = {"model": size, "gpus": train_gpus, "gpu": setup.gpu, "mfu": ts.mfu,
                   "recompute": ts.recompute, "speedup": speedup, "relay": setup.relay.model_dump(), **terms}
    if not relays:
        trainer_sim["deliver"] = [{"host": h, "dir": d} for h, d in hosts_dirs.items()]
    data = str(Path(workdir) / "data" / "prompts.jsonl")
    window = min(1.0, setup.periods_sim_s.commit_window / speedup)  # the pools' group-commit window, real s
    return {
        "run": {"name": name or f"sim-{size}-{gpus}-{mode}", "seed": 0, "workdir": workdir, "mode": run_mode_of(mode)},
        "cluster": {
            "keys_dir": None,
            "heartbeat_s": period(setup, "heartbeat", speedup),
            "dead_after_s": setup.real_s.dead_after,
            "shutdown_s": setup.real_s.shutdown,
            "broker": {"host": "ctl"},
            "hosts": hosts,
        },
        "roles": {
            "manager": {"repack_interval_s": period(setup, "repack", speedup), "batch_bound": curve_b,
                        "c_max": setup.manager.c_max, "repack_trend": setup.manager.trend,
                        "rpc_timeout_s": setup.real_s.rpc_timeout,
                        "rollout_dead_after_s": setup.real_s.dead_after,
                        "state_interval_s": period(setup, "heartbeat", speedup)},
            "prompt_pool": {"dataset": data, "group_size": shape.group_size, "commit_window_s": window,
                            "max_tokens": shape.max_output_tokens,
                            **({"max_batches_ahead": ahead} if ahead is not None else {})},
            "partial_pool": {"commit_window_s": window},
            "experience_buffer": {"capacity": 4 * shape.prompts_per_batch * shape.group_size * 4,
                                  "commit_window_s": window,
                                  **({"max_staleness": max_staleness} if max_staleness is not None else {})},
            "rollout": {"engine": "sim", "model_dir": "sim", "max_concurrency": concurrency,
                        **engine_seqs(setup, workload, size, mode, concurrency),
                        **({"refill": True} if rs.refill and mode not in BARRIER_MODES else {}),
                        "max_model_len": shape.max_input_tokens + shape.max_output_tokens, "seed": 0,
                        # the real reward is not computed: its cost is charged in simulated time
                        # (reward_s_by_tokens, in the rollouts' sim engine or the sim trainer)
                        "reward": "laminar.tasks.rewards:zero",
                        "delta_interval_s": period(setup, "delta", speedup),
                        "report_interval_s": period(setup, "report", speedup),
                        "idle_wait_s": period(setup, "idle_wait", speedup),
                        "gated_wait_s": period(setup, "gated_wait", speedup),
                        "rpc_timeout_s": setup.real_s.rpc_timeout, "sim": rollout_sim},
            "trainer": {"engine": "sim", "model_dir": "sim", "groups_per_batch": shape.prompts_per_batch,
                        "publishing": {"enabled": relays}, "logging": {"tensorboard": False},
                        "checkpoint": {"every": 1_000_000, "resume": False},
                        "performance": {"sample_wait_s": period(setup, "sample_wait", speedup)},
                        "max_iterations": iterations,
                        "loss": {"old_logprobs": old_logprobs(setup, mode)}, "sim": trainer_sim},
            **({"relay": {"progress_interval_s": period(setup, "heartbeat", speedup)}} if relays else {}),
        },
    }


def engine_seqs(setup: SimSetup, workload: dict, size: str, mode: str, concurrency: int) -> dict:
    """The rollouts' `max_num_seqs` from paper.yaml's rollout.max_num_seqs: absent/None: none (the
    engine runs all max_concurrency trajectories, preempting when its KV cache runs out, as vLLM
    does); "kv": the mode's b* (KV capacity ÷ the tokens a sequence holds on average over its life,
    ideal_replica_tokens_per_s), the same for every mode; a number: that."""
    cap = setup.rollout.max_num_seqs
    if cap is None:
        return {}
    n = ideal_replica_tokens_per_s(setup, workload, size, mode)[1] if cap == "kv" else int(cap)
    return {"max_num_seqs": max(1, min(n, concurrency))}


def write_prompts(cfg: dict, setup: SimSetup | int, n: int) -> Path:
    """The synthetic prompt set of a scenario: `n` unique prompts of `prompt_tokens` tokens each
    (byte tokenizer: BOS + one token per byte), written where the prompt pool reads it.
    `setup`: the setups dict (its run_shape.prompt_tokens) or the token count itself."""
    path = Path(cfg["roles"]["prompt_pool"]["dataset"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens = setup if isinstance(setup, int) else setup.run_shape.prompt_tokens
    width = tokens - 1
    with open(path, "w") as f:
        for i in range(n):
            head = f"problem {i}: "
            f.write(json.dumps({"id": str(i), "prompt": (head + "x" * width)[:width], "answer": "0"}) + "\n")
    return path


_LENGTH_STATS: dict = {}


def _length_stats(setup: SimSetup, workload: dict, size: str) -> dict:
    """Mean, E[L²], E[L²]/(2E[L]), the expected longest of a global batch, and the mean cost of
    scoring one response (paper.yaml `reward`; 0 without it), of a model's lengths."""
    shape = setup.run_shape
    points = reward_points(setup)
    key = (size, setup.model_setup(size).lengths, shape.max_output_tokens, shape.prompts_per_batch * shape.group_size,
           json.dumps(points))
    if key not in _LENGTH_STATS:
        dist = workload_lengths(setup.model_setup(size).lengths, workload, shape.max_output_tokens)
        x = dist.sample(0, 200_000).astype(float)
        batch = shape.prompts_per_batch * shape.group_size
        mean, second = float(x.mean()), float((x ** 2).mean())
        reward = float(np.mean(RewardCost.from_points(points).seconds(x))) if points else 0.0
        _LENGTH_STATS[key] = {"mean": mean, "second_moment": second, "half_second_moment": second / (2 * mean),
                              "batch_max": float(dist.quantile(1 - 1 / (2 * batch))), "reward_s_mean": reward}
    return _LENGTH_STATS[key]


def step_curve(setup: SimSetup, workload: dict, size: str, tp: int | None = None) -> StepCurve:
    """The decode step curve of a model at `tp` (default: the laminar TP): the paper's, else the
    fitted roofline's (latency.model_curve)."""
    return model_curve(size, int(tp or setup.model_setup(size).tp), workload, setup.gpu)


def engine_curve(setup: SimSetup, workload: dict, size: str, tp: int | None = None) -> StepCurve:
    """The step curve as the sim engine charges it at the curve's context (the host's dispatch
    time per step included), on every batch from 1 to 1,024: what repack's bound B is read from.
    The host floor makes a step's time flat up to the batch where the GPU's time passes it, so B
    there is far larger than on the microbenchmark alone (32B TP4: 16 on the curve, ~290 in the
    running engine): below it, another sequence costs a step nothing."""
    tp = int(tp or setup.model_setup(size).tp)
    batches = range(1, 1025)
    return StepCurve(tuple(float(b) for b in batches),
                     tuple(step_ms(setup, workload, size, tp, b, None) for b in batches),
                     source=f"engine:{size}_TP{tp}")


def step_ms(setup: SimSetup, workload: dict, size: str, tp: int, batch: int, context: float | None) -> float:
    """A decode step as the sim engine charges it (latency.decode_step_ms with the engine's
    context dependence and host time per step)."""
    rs, m, g = setup.rollout, model_shape(size), gpu_spec(setup.gpu)
    per_layer = HOST_MS_PER_LAYER if rs.host_ms_per_layer is None else rs.host_ms_per_layer
    kv = kv_ms_per_token(m, g, tp) if rs.context_dependence else 0.0
    return decode_step_ms(step_curve(setup, workload, size, tp), batch, context, kv_ms_per_token=kv,
                          host_step_ms=per_layer * m.layers, host_ms_per_seq=rs.host_ms_per_seq)


def ideal_replica_tokens_per_s(setup: SimSetup, workload: dict, size: str, mode: str = "laminar") -> tuple[float, int]:
    """(tokens/s, b*) of one replica of `mode` always at b* = min(max_concurrency, KV capacity ÷
    the mean tokens a sequence holds over its life, P + E[L²]/(2E[L])): b* ÷ step(b*), the step
    at that context (as the sim engine charges it)."""
    shape, rs = setup.run_shape, setup.rollout
    tp = mode_tp(setup, size, mode)
    mem = rs.mem_fraction_colocated if mode == "sync" else rs.mem_fraction
    kv = kv_capacity_tokens(model_shape(size), gpu_spec(setup.gpu), tp, mem)
    held = shape.prompt_tokens + _length_stats(setup, workload, size)["half_second_moment"]
    b = max(1, min(shape.max_concurrency, int(kv // held)))
    return b / (step_ms(setup, workload, size, tp, b, b * held) / 1000.0), b


def trainer_cost(setup: SimSetup, workload: dict, size: str, gpus: int, mode: str) -> TrainerCost:
    """The TrainerCost a mode's sim trainer charges (old-logprob pass included)."""
    terms = trainer_terms(setup, workload, size, gpus, mode)
    points = terms.pop("reward_s_by_tokens", None)
    terms = {k: v for k, v in terms.items() if k not in ("nccl", "balance", "colocated")}
    extra = 1 if old_logprobs(setup, mode) == "recompute" else 0
    return TrainerCost.build(size, setup.gpu, placement(workload, size, gpus, mode)[0], mfu=setup.trainer.mfu,
                             recompute=setup.trainer.recompute, extra_forward_passes=extra,
                             reward=RewardCost.from_points(points) if points else None, **terms)


def estimate(setup: SimSetup, workload: dict, size: str, gpus: int, mode: str) -> dict:
    """A back-of-envelope iteration time from the simulator's own cost models — used only to pick
    a run's speedup and timeout, never reported as a result:
      train   = TrainerCost(train GPUs).iteration_s(batch tokens)
      gen     = batch response tokens ÷ (replicas × ideal replica tokens/s)
      tail    = the batch's expected longest response × the batch-1 step time (barrier modes)
      laminar modes: max(train, gen); sync: max(gen, tail) + train; one_step/stream: max(gen, tail, train)."""
    shape = setup.run_shape
    train_gpus, roll_gpus = placement(workload, size, gpus, mode)
    tp = mode_tp(setup, size, mode)
    replicas = roll_gpus // tp
    batch = shape.prompts_per_batch * shape.group_size
    ls = _length_stats(setup, workload, size)
    cost = trainer_cost(setup, workload, size, gpus, mode)
    p, mean = shape.prompt_tokens, ls["mean"]
    squares = batch * (p * p + 2 * p * mean + ls["second_moment"])  # Σ (P + L)²
    train = cost.iteration_s(int(batch * (p + mean)), batch, squares)
    if cost.reward is not None:  # the driver scores the batch: its mean cost × the batch
        train += batch * ls["reward_s_mean"]
    per_replica, _ = ideal_replica_tokens_per_s(setup, workload, size, mode)
    gen = batch * ls["mean"] / (replicas * per_replica)
    tail = ls["batch_max"] * step_ms(setup, workload, size, tp, 1, None) / 1000.0
    if mode.startswith("laminar"):
        it = max(train, gen)
    elif mode == "sync":
        it = max(gen, tail) + train
    else:
        it = max(gen, tail, train)
    ct = setup.compressed_time
    cpu_per_traj = ct.cpu_per_trajectory_s + ct.cpu_per_token_s * ls["mean"]
    rate = batch / it
    cpu_per_sim_s = cpu_per_traj * rate + ct.cpu_per_replica_s * replicas
    speedup = min(ct.max, max(ct.min, ct.cpu_share / cpu_per_sim_s))
    return {"iteration_s": it, "train_s": train, "gen_s": gen, "tail_s": tail, "trajectories_per_s": rate,
            "cpu_per_trajectory_s": cpu_per_traj, "speedup": round(speedup, 2), "replicas": replicas}
