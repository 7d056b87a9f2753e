"""One rank of a multi-rank TrainEngine run, for tests: FSDP2 over gloo on CPU (NCCL on GPUs).

    python -m laminar.testing.trainer_ranks RANK WORLD ADDRESS MODEL_DIR OUT [--algorithm grpo|ppo]
        [--versions 2] [--device cpu]

Every rank trains the same synthetic batches (random_groups, seeded) for `--versions` versions;
rank 0 writes OUT (torch.save): the full model state dict after training and each version's
metrics. A test compares that with one process training the same batches (`train_reference`).
"""
from __future__ import annotations

import argparse

SETTINGS = dict(lr=1e-3, critic_lr=1e-3, minibatch_steps=2, micro_batch_size=3)


def batches(versions: int) -> list:
    from laminar.testing.trainer_task import random_groups
    # 15 sequences: mini-batches of 8 and 7, shares of 4/4 and 4/3 -> one rank forwards an empty chunk
    return [random_groups(3, 5, f"v{v}", resp_len=6 + v, prompt_len=5, seed=v) for v in range(versions)]


def make_config(model_dir: str, algorithm: str, device: str):
    from laminar.roles.trainer.config import TrainerConfig
    return TrainerConfig(model_dir=model_dir, algorithm=algorithm, device=device, **SETTINGS)


def train_reference(model_dir: str, algorithm: str = "grpo", versions: int = 2, device: str = "cpu") -> dict:
    """The same run on one rank: {"model": state_dict, "metrics": [per version]}."""
    import torch

    from laminar.roles.trainer.engine import TrainEngine
    torch.manual_seed(0)
    eng = TrainEngine(make_config(model_dir, algorithm, device), 0, torch.device(device))
    eng.load()
    metrics = [eng.train(b, v + 1) for v, b in enumerate(batches(versions))]
    return {"model": {k: v.detach().cpu().clone() for k, v in eng.full_state()["model"].items()}, "metrics": metrics}


def main() -> None:
    import torch

    from laminar.roles.trainer import dist
    from laminar.roles.trainer.engine import TrainEngine
    ap = argparse.ArgumentParser()
    ap.add_argument("rank", type=int)
    ap.add_argument("world", type=int)
    ap.add_argument("address")
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--algorithm", default="grpo")
    ap.add_argument("--versions", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = torch.device(a.device if a.device == "cpu" else f"cuda:{a.rank}")
    info = dist.init(a.rank, a.world, a.address, device, timeout_s=120)
    try:
        eng = TrainEngine(make_config(a.model_dir, a.algorithm, a.device), 0, device, info)
        eng.load()
        metrics = [eng.train(b, v + 1) for v, b in enumerate(batches(a.versions))]
        state = eng.full_state()
        if info.is_main:
            torch.save({"model": state["model"], "metrics": metrics}, a.out)
    finally:
        dist.shutdown(info)


if __name__ == "__main__":
    main()
