"""Mixture-of-experts helpers for tests and benchmarks: a Hugging Face model's own routing of a
sequence, in the layout trajectories carry it (laminar/models/routing.py).

    rows = hf_routing(model, prompt + response)     # uint8 [len - 1, moe_layers, top_k]
    trajs = with_routing(model, groups)              # each trajectory with its routing attached
    python -m laminar.testing.moe RANK WORLD ADDRESS MODEL_DIR OUT   # one rank of an FSDP2 MoE trainer

The rank program trains `routed_groups` (synthetic batches carrying shifted routing, so replay
matters) with routing replay; rank 0 writes the full state, the metrics and every rank's local
expert tensor shapes (FSDP2 shards the expert dimension); `train_moe` is the one-process reference.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from laminar.models.routing import routing_dtype


def hf_routing(model, tokens) -> np.ndarray:
    """The experts `model`'s routers pick for positions [0, len(tokens) - 1) of `tokens` (the
    positions an engine processes when it samples the rest), one forward, no grad."""
    import torch

    from laminar.roles.trainer.routing_replay import find_routers
    routers = find_routers(model)
    seen: dict[int, np.ndarray] = {}
    hooks = [r.register_forward_hook(lambda m, i, out, k=k: seen.__setitem__(k, out[2].detach().cpu().numpy()))
             for k, (_, r) in enumerate(routers)]
    try:
        with torch.no_grad():
            model(torch.as_tensor(np.asarray(tokens, np.int64))[None], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    rows = np.stack([seen[k] for k in range(len(routers))], axis=1)[: len(tokens) - 1]
    return rows.astype(routing_dtype(int(routers[0][1].weight.shape[0])))


def with_routing(model, groups, transform=None) -> list:
    """`groups` of Trajectory with `routing` set to the model's own (through `transform(rows)` if
    given: e.g. a corrupted copy)."""
    out = []
    for g in groups:
        row = []
        for t in g:
            rows = hf_routing(model, list(t.spec.prompt_tokens) + list(t.response_tokens))
            row.append(replace(t, routing=transform(rows) if transform else rows))
        out.append(row)
    return out


def routed_groups(model_dir: str, versions: int = 2) -> list:
    """Synthetic GRPO batches (trainer_task.random_groups) whose trajectories carry routing: the
    model's own experts shifted by 3 (so replaying them changes the logprobs), the same on every
    rank (a deterministic CPU forward)."""
    from laminar.models.loading import load_causal_lm
    from laminar.testing.trainer_task import random_groups
    model = load_causal_lm(model_dir, "cpu", train=False)
    shift = lambda r: ((r.astype(np.int64) + 3) % 8).astype(r.dtype)  # noqa: E731
    return [with_routing(model, random_groups(3, 5, f"moe{v}", resp_len=6 + v, prompt_len=5, seed=v), shift)
            for v in range(versions)]


def train_moe(model_dir: str, info=None, device: str = "cpu", versions: int = 2) -> dict:
    """TrainEngine with routing replay over `routed_groups`: the full state (rank 0), every version's
    metrics, and the local shapes of this rank's expert tensors. The load-balancing loss is off: it
    is taken per micro-batch (a product of the micro-batch's averages), so ranks that cut the batch
    otherwise than one process train slightly other weights."""
    import torch

    from laminar.roles.trainer.config import TrainerConfig
    from laminar.roles.trainer.engine import TrainEngine
    torch.manual_seed(0)
    settings = TrainerConfig(model_dir=model_dir, optimizer={"lr": 1e-3}, minibatch_steps=2, device=device,
                             performance={"micro_batch_size": 3}, logging={"mismatch_previous_version": False},
                             moe={"routing_replay": True, "router_aux_loss_coef": 0.0})
    eng = TrainEngine(settings, 0, torch.device(device), info) if info is not None else \
        TrainEngine(settings, 0, torch.device(device))
    eng.load()
    shards = {n: tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape)
              for n, p in eng.models.model.named_parameters() if ".experts." in n}
    metrics = [eng.train(b, v + 1) for v, b in enumerate(routed_groups(model_dir, versions))]
    state = eng.full_state()
    return {"model": state["model"] if state else None, "metrics": metrics, "shards": shards}


def main() -> None:
    """One rank of a multi-rank MoE trainer (tests): python -m laminar.testing.moe RANK WORLD ADDRESS MODEL OUT."""
    import argparse

    import torch

    from laminar.roles.trainer import dist
    ap = argparse.ArgumentParser()
    for name in ("rank", "world", "address", "model_dir", "out"):
        ap.add_argument(name)
    a = ap.parse_args()
    torch.set_num_threads(1)
    info = dist.init(int(a.rank), int(a.world), a.address, torch.device("cpu"), timeout_s=120)
    try:
        out = train_moe(a.model_dir, info)
        out["shards"] = dist.all_gather_objects(info, out["shards"])
        if info.is_main:
            torch.save(out, a.out)
    finally:
        dist.shutdown(info)


if __name__ == "__main__":
    main()
