"""Chunked logprobs (roles/trainer/logprobs.py): per-token logprobs and entropies computed from the
last hidden state in chunks of tokens, forward and backward, equal the unchunked log-softmax of the
full logits within 1e-5 in float32 (values and every parameter's gradient), padded and packed, and
never make a tensor of the full [tokens, vocabulary] size; the trainer trains the same with them
(activation checkpointing on)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from laminar.roles.trainer.batching import collate  # noqa: E402
from laminar.roles.trainer.config import TrainerConfig  # noqa: E402
from laminar.roles.trainer.engine import TrainEngine  # noqa: E402
from laminar.roles.trainer.logprobs import chunked_logprobs, full_logprobs, token_logprobs  # noqa: E402
from laminar.roles.trainer.packing import packed_token_logprobs  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from laminar.models.loading import load_causal_lm  # noqa: E402
from laminar.models.tiny import VOCAB, build_tiny_model  # noqa: E402
from laminar.testing.settings import deep_merge  # noqa: E402
from laminar.testing.trainer_task import random_groups  # noqa: E402


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """A tiny model of hidden 32: fewer hidden units than target positions, so a [tokens, vocab]
    tensor is larger than anything the weights account for."""
    return build_tiny_model(tmp_path_factory.mktemp("narrow") / "m", seed=0, init_std=0.2, hidden=32,
                            intermediate=64, heads=4, kv_heads=2)


def ragged_batch(seed: int = 0, n: int = 5):
    """n right-padded sequences, prompts of 3..9 and responses of 4..30 tokens."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, VOCAB, int(rng.integers(3, 10))) for _ in range(n)]
    responses = [rng.integers(3, VOCAB, int(rng.integers(4, 31))) for _ in range(n)]
    ids, att, mask, _ = collate(prompts, responses)
    return ids, att, mask


def grads_of(model, fn, valid):
    """(logp, entropy, {name: grad}) of a fixed random weighting of the `valid` logprobs."""
    model.zero_grad(set_to_none=True)
    logp, ent = fn()
    w = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1)) * valid
    (logp * w).sum().backward()
    return logp.detach(), ent, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_chunked_logprobs_equal_unchunked_values_and_gradients(narrow, chunk):
    model = load_causal_lm(narrow, "cpu")
    ids, att, mask = ragged_batch()
    valid = att[:, 1:].bool()  # target positions inside a sequence
    ref_lp, ref_ent, ref_g = grads_of(model, lambda: token_logprobs(model, ids, att, with_entropy=True,
                                                                    chunk_tokens=0), valid)
    lp, ent, g = grads_of(model, lambda: token_logprobs(model, ids, att, with_entropy=True, chunk_tokens=chunk),
                          valid)
    assert float((lp - ref_lp)[valid].abs().max()) <= 1e-5
    assert float((ent - ref_ent)[valid].abs().max()) <= 1e-5
    assert ent.requires_grad is False
    assert g.keys() == ref_g.keys() and "model.embed_tokens.weight" in g  # tied with the head
    for k in ref_g:  # float32: 1e-5 absolute, or relative where a gradient is larger than 1
        assert torch.allclose(g[k], ref_g[k], atol=1e-5, rtol=1e-5), k


def test_chunked_logprobs_of_a_packed_row_equal_the_padded_batch(narrow):
    model = load_causal_lm(narrow, "cpu")
    ids, att, mask = ragged_batch(seed=3)
    valid = att[:, 1:].bool()
    ref_lp, ref_ent, ref_g = grads_of(model, lambda: token_logprobs(model, ids, att, with_entropy=True,
                                                                    chunk_tokens=0), valid)
    lp, ent, g = grads_of(model, lambda: packed_token_logprobs(model, ids, att, with_entropy=True, chunk_tokens=9),
                          valid)
    assert float((lp - ref_lp)[valid].abs().max()) <= 1e-5
    assert float((ent - ref_ent)[valid].abs().max()) <= 1e-5
    for k in ref_g:  # float32: 1e-5 absolute, or relative where a gradient is larger than 1
        assert torch.allclose(g[k], ref_g[k], atol=1e-5, rtol=1e-5), k


def test_chunked_math_with_a_head_bias_and_bf16_autocast():
    """The function alone: a bias folds into the logits; under bf16 autocast the chunks compute what
    autocast computes for the full logits (bf16 matmul, fp32 log-softmax), to bf16 rounding."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(50, 16, generator=g, requires_grad=True)
    w = torch.randn(300, 16, generator=g, requires_grad=True)
    b = torch.randn(300, generator=g, requires_grad=True)
    t = torch.randint(0, 300, (50,), generator=g)
    outs = {}
    for name, fn in {"full": lambda: full_logprobs(h, w, t, True, bias=b),
                     "chunked": lambda: chunked_logprobs(h, w, t, 8, True, bias=b)}.items():
        lp, ent = fn()
        (lp * torch.arange(50.0)).sum().backward()
        outs[name] = (lp.detach(), ent, h.grad.clone(), w.grad.clone(), b.grad.clone())
        h.grad = w.grad = b.grad = None
    for x, y in zip(outs["full"], outs["chunked"], strict=True):
        assert float((x - y).abs().max()) <= 1e-5 * max(1.0, float(x.abs().max()))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full, _ = full_logprobs(h, w, t, False)
        chunked, _ = chunked_logprobs(h, w, t, 8, False)
    assert full.dtype == chunked.dtype == torch.float32
    assert float((full - chunked).abs().max()) <= 1e-5  # the same bf16 logits, then fp32 alike


class LargestVocabTensor(TorchDispatchMode):
    """Records the largest tensor any op makes (forward and backward) with a dimension of size V."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor) and self.vocab in x.shape:
                self.largest = max(self.largest, x.numel())
        return out


def test_chunked_logprobs_never_make_the_full_token_by_vocab_tensor(narrow):
    model = load_causal_lm(narrow, "cpu")
    ids, att, _ = ragged_batch(seed=5, n=6)
    positions = ids.shape[0] * (ids.shape[1] - 1)
    assert positions > 32  # more target positions than hidden units: weights are [V, 32]
    largest = {}
    for chunk in (0, 16):
        mode = LargestVocabTensor(VOCAB)
        with mode:
            logp, _ = token_logprobs(model, ids, att, with_entropy=True, chunk_tokens=chunk)
            logp.sum().backward()
        largest[chunk] = mode.largest
    assert largest[0] >= positions * VOCAB          # the unchunked pass makes [B, T, V] logits
    assert largest[16] <= 32 * VOCAB < positions * VOCAB   # chunks of 16 tokens, weights of [V, 32]


def engine(model_dir, **kw):
    torch.manual_seed(0)
    base = {"model_dir": str(model_dir), "optimizer": {"lr": 1e-3}, "minibatch_steps": 2,
            "performance": {"micro_batch_size": 5, "activation_checkpointing": True}}
    e = TrainEngine(TrainerConfig(**deep_merge(base, kw)), 0, torch.device("cpu"))
    e.load()
    return e


@pytest.mark.parametrize("kw", [dict(), dict(loss=dict(kl_coef=0.1, off_policy="decoupled"),
                                            performance=dict(packing=True))],
                         ids=["grpo", "kl-decoupled-packed"])
def test_chunked_training_matches_unchunked_training(narrow, kw):
    """The policy, reference and proximal passes all chunked: the same metrics and weights."""
    outs, ws = {}, {}
    for chunk in (0, 6):
        e = engine(narrow, **deep_merge({"performance": {"logprob_chunk_tokens": chunk}}, kw))
        groups = [random_groups(3, 4, f"c{v}", resp_len=9 + v, prompt_len=6, seed=v) for v in range(2)]
        outs[chunk] = [e.train(g, v + 1) for v, g in enumerate(groups)]
        ws[chunk] = {k: v.detach().clone() for k, v in e.models.model.state_dict().items()}
    for a, b in zip(outs[0], outs[6], strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), k
    for k in ws[0]:
        assert torch.allclose(ws[0][k], ws[6][k], atol=1e-5, rtol=1e-4), k


def test_chunked_is_the_default_and_zero_turns_it_off(narrow):
    assert TrainerConfig(model_dir=str(narrow)).performance.logprob_chunk_tokens > 0
    with pytest.raises(ValueError):
        TrainerConfig(model_dir=str(narrow), performance={"logprob_chunk_tokens": -1})
