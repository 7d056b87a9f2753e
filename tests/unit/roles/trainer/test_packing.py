"""Packed micro-batches (roles/trainer/packing.py) on the tiny model: the packed row gives the same
per-token logprobs, entropies, critic values, losses and updates as the padded batch (float
tolerance, CPU sdpa with a block-diagonal mask), a sequence never sees its neighbours, and with
packing off (the CPU default) training is exactly what it was."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from laminar.roles.trainer.batching import collate  # noqa: E402
from laminar.roles.trainer.config import TrainerConfig  # noqa: E402
from laminar.roles.trainer.engine import TrainEngine  # noqa: E402
from laminar.roles.trainer.logprobs import token_logprobs  # noqa: E402
from laminar.roles.trainer.packing import pack, packed_token_logprobs, packed_values, unpack  # noqa: E402

from laminar.models.loading import load_causal_lm  # noqa: E402
from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.testing.settings import deep_merge  # noqa: E402
from laminar.testing.trainer_task import random_groups  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def ragged_groups(seed: int):
    """3 groups of 4 with prompts of 5..11 tokens and responses of 2..12 tokens, one tool span."""
    rng = np.random.default_rng(seed)
    out = []
    for g, group in enumerate(random_groups(3, 4, f"r{seed}", resp_len=12, prompt_len=12, seed=seed)):
        plen = int(rng.integers(5, 12))
        spec_prompt = group[0].spec.prompt_tokens[:plen]
        new = []
        for t in group:
            n = int(rng.integers(2, 13))
            mask = np.ones(n, np.uint8)
            if g == 1 and n > 4:
                mask[1:3] = 0  # a tool's output inside the response
            new.append(dataclasses.replace(t, spec=dataclasses.replace(t.spec, prompt_tokens=spec_prompt),
                                           response_tokens=t.response_tokens[:n], logprobs=t.logprobs[:n],
                                           loss_mask=mask))
        out.append(new)
    return out


def batch(groups):
    trajs = [t for g in groups for t in g]
    return collate([t.spec.prompt_tokens for t in trajs], [t.response_tokens for t in trajs])


def test_pack_layout_and_unpack_round_trip():
    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 0, 0, 0], [1, 2, 3, 4, 5]])
    att = (ids != 0).long()
    p = pack(ids, att)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4, 5]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 4]]
    # target position t of sequence b is packed position offset_b + t, for t < L_b - 1
    assert p.valid.tolist() == [[True, True, False, False], [True, False, False, False], [True] * 4]
    row = torch.arange(10, dtype=torch.float32)[None] + 100
    assert unpack(row, p).tolist() == [[100, 101, 0, 0], [103, 0, 0, 0], [105, 106, 107, 108]]


def test_packed_logprobs_entropy_and_values_match_the_padded_batch(tiny):
    from laminar.algorithms.ppo import load_critic
    model = load_causal_lm(tiny, "cpu", train=False)
    ids, att, mask, _ = batch(ragged_groups(1))
    assert int(att.sum()) < att.numel()  # there is padding to skip
    with torch.no_grad():
        lp, ent = token_logprobs(model, ids, att, with_entropy=True)
        plp, pent = packed_token_logprobs(model, ids, att, with_entropy=True)
        inside = pack(ids, att).valid
        assert torch.allclose(plp[inside], lp[inside], atol=1e-5, rtol=0)
        assert torch.allclose(pent[inside], ent[inside], atol=1e-5, rtol=0)
        assert (plp[~inside] == 0).all()  # no token there: nothing computed
        critic = load_critic(tiny)
        torch.nn.init.normal_(critic.value_head.weight, std=0.5)  # non-zero values to compare
        v, pv = critic(ids, att)[:, :-1], packed_values(critic, ids, att)
        assert torch.allclose(pv[inside], v[inside], atol=1e-5, rtol=0)


def test_packed_flex_attention_matches_the_padded_batch(tiny):
    """The CUDA default without flash_attn: flex attention (block-sparse mask from the positions),
    checked here on the CPU (transformers compiles it: ~20 s)."""
    model = load_causal_lm(tiny, "cpu", train=False)
    ids, att, _, _ = batch(ragged_groups(6))
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, att)
        model.set_attn_implementation("flex_attention")
        plp, _ = packed_token_logprobs(model, ids, att)
    inside = pack(ids, att).valid
    assert torch.allclose(plp[inside], lp[inside], atol=1e-5, rtol=0)


def test_a_packed_sequence_never_sees_its_neighbours(tiny):
    model = load_causal_lm(tiny, "cpu", train=False)
    ids, att, _, _ = batch(ragged_groups(2))
    other = ids.clone()
    other[0] = torch.where(att[0] > 0, (ids[0] * 7 + 3) % 250 + 3, ids[0])  # sequence 0's tokens replaced
    with torch.no_grad():
        a, _ = packed_token_logprobs(model, ids, att)
        b, _ = packed_token_logprobs(model, other, att)
    assert not torch.equal(a[0], b[0])
    assert torch.equal(a[1:], b[1:])


def engine(tiny, **kw):
    torch.manual_seed(0)
    base = {"model_dir": str(tiny), "optimizer": {"lr": 1e-3}, "performance": {"micro_batch_size": 5},
            "minibatch_steps": 2}
    e = TrainEngine(TrainerConfig(**deep_merge(base, kw)), 0,
                    torch.device("cpu"))
    e.load()
    return e


def weights(e):
    sd = {f"model.{k}": v for k, v in e.models.model.state_dict().items()}
    if e.models.critic is not None:
        sd.update({f"critic.{k}": v for k, v in e.models.critic.state_dict().items()})
    return {k: v.detach().clone() for k, v in sd.items()}


@pytest.mark.parametrize("kw", [dict(), dict(algorithm="ppo"),
                                dict(loss=dict(kl_coef=0.1, off_policy="decoupled", dual_clip=True))],
                         ids=["grpo", "ppo", "grpo-kl-decoupled"])
def test_packed_training_matches_padded_training(tiny, kw):
    outs, ws = {}, {}
    for packing in (False, True):
        e = engine(tiny, **deep_merge({"performance": {"packing": packing}}, kw))
        assert e.forwards.packing is packing
        outs[packing] = [e.train(ragged_groups(3), 1), e.train(ragged_groups(4), 2)]
        ws[packing] = weights(e)
    for a, b in zip(outs[False], outs[True], strict=True):
        assert a.keys() == b.keys()
        assert a["tokens"] == b["tokens"] and a["response_tokens"] == b["response_tokens"]
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), k
    assert ws[False].keys() == ws[True].keys()
    assert_same_update(ws[False], ws[True], lr=1e-3)


def assert_same_update(a: dict, b: dict, lr: float) -> None:
    """Weights after the same Adam steps from gradients equal to float rounding: Adam turns a
    near-zero gradient into a ~lr step whose sign is at the mercy of summation order (the packed row
    and the padded batch sum the head's gradient in different orders), so a rare element may differ
    by up to 2 lr; the rest must agree to float precision (the gradient norms are compared before
    Adam normalizes, in the metrics)."""
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    assert float(diff.max()) <= 2 * lr + 1e-6
    assert float((diff > 1e-5).float().mean()) < 1e-4


def test_packing_is_off_on_the_cpu_by_default_and_then_identical(tiny):
    a, b = engine(tiny), engine(tiny, performance={"packing": False})
    assert a.forwards.packing is False
    assert a.train(ragged_groups(5), 1) == b.train(ragged_groups(5), 1)
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
