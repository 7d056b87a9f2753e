"""PPO with a critic (an option, docs/architecture.md §9; docs/learning.md): generalized advantage
estimation, the clipped value loss and the critic itself (the policy's transformer body + a
linear value head). The policy term is the clipped policy loss of grpo.py (`clipped_policy_loss`).

Token-level MDP: one reward per token (usually only the last one is non-zero), a value per
token; `mask` marks the policy's own tokens and the episode ends after the last of them
(bootstrap 0). A masked token inside a response (a tool's output in a multi-turn episode) is not
an end: the recursion skips it, carrying the next value and the running advantage across, so
every turn learns from the outcome reward (as verl does); right padding is skipped the same way.
"""
from __future__ import annotations

from laminar.models.loading import read_config, torch_dtype


def gae(rewards, values, mask, gamma: float = 1.0, lam: float = 0.95):
    """Advantages and returns [B, T] by GAE(gamma, lambda) over the valid tokens only:
        delta_t = r_t + gamma V_n - V_t,   A_t = delta_t + gamma lam A_n
    where n is the next *valid* token after t (none: V_n = A_n = 0), computed right to left.
    Masked positions get 0 and neither their values nor their rewards enter the recursion.
    returns = A + V."""
    import torch  # late: torch; configs validate without it
    mask = mask.float()
    B, T = rewards.shape
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    last = torch.zeros(B, dtype=torch.float32)    # A_n, carried across masked tokens
    next_v = torch.zeros(B, dtype=torch.float32)  # V_n, carried across masked tokens
    for t in range(T - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        a = delta + gamma * lam * last
        valid = mask[:, t] > 0
        adv[:, t] = a * mask[:, t]
        last = torch.where(valid, a, last)
        next_v = torch.where(valid, values[:, t].float(), next_v)
    return adv, (adv + values) * mask


def value_loss(values, old_values, returns, mask, clip: float | None = 0.2, num_tokens: float | None = None):
    """0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2), token-level mean over mask."""
    import torch  # late: torch; configs validate without it
    mask = mask.float()
    n = float(num_tokens) if num_tokens is not None else max(float(mask.sum()), 1.0)
    err = (values - returns) ** 2
    if clip is not None:
        vc = old_values + torch.clamp(values - old_values, -clip, clip)
        err = torch.maximum(err, (vc - returns) ** 2)
    return 0.5 * (err * mask).sum() / n


def sequence_gae(reward: float, values, gamma: float = 1.0, lam: float = 0.95, mask=None):
    """GAE of one response whose only reward comes at its last token: (advantages, returns), 1-D
    float32 numpy arrays of the response's length. `values` are the critic's values of the states
    before each response token; a token with mask 0 (tool output) gets 0 and is skipped: the
    value and the advantage of the next policy token carry across it."""
    import numpy as np  # late: numpy beside torch, both loaded only when a loss is computed
    import torch
    v = torch.as_tensor(np.asarray(values, np.float32))[None]
    m = torch.ones_like(v) if mask is None else torch.as_tensor(np.asarray(mask, np.float32))[None]
    r = torch.zeros_like(v)
    valid = torch.nonzero(m[0]).flatten()
    if len(valid):
        r[0, int(valid[-1])] = float(reward)
    adv, ret = gae(r, v, m, gamma, lam)
    return adv[0].numpy(), ret[0].numpy()


def load_critic(model_dir, device="cpu", dtype: str = "float32"):
    """The critic: the policy's transformer body (from the same local folder) + a zero-initialised
    linear value head; forward(input_ids, attention_mask) -> one value per input position [B, T]."""
    import torch  # late: torch; configs validate without it
    import transformers

    read_config(model_dir)
    body = transformers.AutoModel.from_pretrained(str(model_dir), dtype=torch_dtype(dtype), local_files_only=True)

    class Critic(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model  # `.model.layers` is what FSDP2 shards per layer
            self.value_head = torch.nn.Linear(model.config.hidden_size, 1, dtype=torch_dtype(dtype))
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)

        def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
            h = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           **kwargs).last_hidden_state
            return self.value_head(h).squeeze(-1).float()

    return Critic(body).to(device).train()
