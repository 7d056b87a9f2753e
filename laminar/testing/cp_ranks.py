"""One rank of a context-parallel check, for tests: TrainEngine variants on gloo ranks, one micro-batch's
logprobs, entropies, loss and every gradient, then two versions of training.

    python -m laminar.testing.cp_ranks RANK WORLD ADDRESS MODEL_DIR OUT --variants JSON

Each variant is a dict of trainer settings (e.g. {"distributed": {"context_parallel_size": 2},
"performance": {"packing": true}}). Every rank builds an engine with it and
1. forwards one micro-batch of long-tailed sequences (the first `--micro` of the first batch; odd
   lengths, so the CP split pads), the policy loss (Clip-Higher, against random behaviour logprobs
   and advantages) scaled as the engine scales it, and its backward; then
2. trains the long-tailed batches of laminar.testing.trainer_ranks for `--versions` versions.
Rank 0 writes OUT (torch.save): per variant {"logp", "entropy", "mask", "loss", "grads" {name: full
gradient}, "metrics" [per version], "model" (the full state dict after training)}, for a test to
compare a CP run with one process (WORLD 1, context_parallel_size 1) on the same variant.
"""
from __future__ import annotations

import json

from laminar.testing.load_ranks import rank_parser


def one_micro_batch(eng, trajs, n: int) -> dict:
    """Forward and backward of the first `n` sequences (the same on every rank): what rank 0 keeps."""
    import torch

    from laminar.algorithms.grpo import clipped_policy_loss
    idx = list(range(n))
    gen = torch.Generator().manual_seed(5)
    per = {"beh": [(-torch.rand(len(trajs[i].response_tokens), generator=gen)).numpy() for i in range(len(trajs))]}
    ids, att, mask, ex = eng.forwards.inputs(trajs, idx, per)
    adv = torch.randn(n, generator=gen)
    eng.models.opt.zero_grad(set_to_none=True)
    logp, ent = eng.forwards.logprobs(eng.models.model, ids, att, with_entropy=True)
    loss, _ = clipped_policy_loss(logp, ex["beh"], adv, mask, num_tokens=int(mask.sum()), entropy=ent)
    # the engine's scale (FSDP2 averages, the sum is wanted); every data-parallel group forwards this same
    # micro-batch here, so their sum is divided out: the gradient of one micro-batch, as one process has it
    (loss * eng._grad_scale() / eng.info.dp_size).backward()
    grads = {}
    for name, p in eng.models.model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = g.detach().clone()
    eng.models.opt.zero_grad(set_to_none=True)
    return {"logp": logp.detach().clone(), "entropy": ent.detach().clone() if ent is not None else None,
            "mask": mask.clone(), "loss": float(loss.detach()), "grads": grads}


def main() -> None:
    import torch

    from laminar.roles.trainer import dist
    from laminar.roles.trainer.engine import TrainEngine
    from laminar.testing.settings import deep_merge
    from laminar.testing.trainer_ranks import long_tailed_batches, make_config
    ap = rank_parser()
    ap.add_argument("--variants", required=True, help="JSON list of trainer settings")
    ap.add_argument("--versions", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4, help="sequences of the checked micro-batch")
    a = ap.parse_args()
    torch.set_num_threads(1)
    info = dist.init(a.rank, a.world, a.address, torch.device("cpu"), timeout_s=300)
    out = []
    try:
        for settings in json.loads(a.variants):
            torch.manual_seed(0)
            cfg = make_config(a.model_dir, "grpo", "cpu",
                              **deep_merge({"distributed": {"world_size": a.world}}, settings))
            eng = TrainEngine(cfg, 0, torch.device("cpu"), info)
            eng.load()
            batches = long_tailed_batches(a.versions)
            trajs = [t for g in batches[0] for t in g]
            got = one_micro_batch(eng, trajs, a.micro)
            got["metrics"] = [eng.train(b, v + 1) for v, b in enumerate(batches)]
            state = eng.full_state()
            if info.is_main:
                got["model"] = state["model"]
                out.append(got)
        if info.is_main:
            torch.save(out, a.out)
    finally:
        dist.shutdown(info)


if __name__ == "__main__":
    main()
