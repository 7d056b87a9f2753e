"""Mixture-of-experts helpers for tests and benchmarks: a Hugging Face model's own routing of a
sequence, in the layout trajectories carry it (laminar/models/routing.py).

    rows = hf_routing(model, prompt + response)     # uint8 [len - 1, moe_layers, top_k]
    trajs = with_routing(model, groups)              # each trajectory with its routing attached
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
