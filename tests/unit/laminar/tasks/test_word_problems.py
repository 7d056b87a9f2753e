"""The demo's reasoning task (laminar/tasks/word_problems.py): three disjoint splits, worked
solutions whose every step is right and whose boxed answer math-verify accepts, solution lengths
long-tailed (p99/p50 >= 5 in bytes, the byte-level model's tokens), and files the prompt pool and
the evaluator read as they are."""
from __future__ import annotations

import re

import numpy as np
import pytest

from laminar.datasets import load_records
from laminar.tasks.math import math_score
from laminar.tasks.word_problems import problem, splits, write

STEP = re.compile(r"(\d+) ([+-]) (\d+) = (\d+)\.")


@pytest.fixture(scope="module")
def sets():
    return splits(0)


def test_splits_are_disjoint_and_sized(sets):
    assert {k: len(v) for k, v in sets.items()} == {"heldout": 128, "prompts": 2048, "sft": 4000}
    texts = [{r["prompt"] for r in v} for v in sets.values()]
    assert sum(map(len, texts)) == len(set.union(*texts))  # no prompt in two splits (nor twice in one)
    ids = [r["id"] for v in sets.values() for r in v]
    assert len(ids) == len(set(ids))


def test_every_step_is_right_and_the_answer_verifies(sets):
    for r in sets["heldout"] + sets["prompts"][:200]:
        steps = STEP.findall(r["solution"])
        assert len(steps) == r["steps"]
        start = int(re.search(r"has (\d+) ", r["prompt"]).group(1))
        total = start
        for a, op, b, c in steps:
            assert int(a) == total
            total = int(a) + int(b) if op == "+" else int(a) - int(b)
            assert total == int(c) and total >= 0
        assert str(total) == r["answer"]
        assert math_score(r["solution"], r["answer"]) == 1.0
        assert math_score(r["solution"].replace(f"{{{total}}}", f"{{{total + 1}}}"), r["answer"]) == 0.0


@pytest.mark.parametrize("split", ["prompts", "heldout"])
def test_solution_lengths_are_long_tailed(sets, split):
    lens = np.array([len(r["solution"].encode()) for r in sets[split]])
    p50, p99 = np.percentile(lens, 50), np.percentile(lens, 99)
    assert p99 / p50 >= 5, (p50, p99)
    steps = np.array([r["steps"] for r in sets[split]])
    assert np.corrcoef(steps, lens)[0, 1] > 0.9  # the length comes from the problem (its steps)


def test_deterministic_and_held_out_split_stable_under_resizing():
    assert splits(3) == splits(3)
    assert splits(3, {"heldout": 16, "prompts": 10, "sft": 10})["heldout"] == splits(3)["heldout"][:16]
    import random
    assert problem(random.Random(1)) == problem(random.Random(1))


def test_written_files_load_as_the_pool_reads_them(tmp_path):
    paths = write(tmp_path, seed=0, sizes={"heldout": 8, "prompts": 16, "sft": 4})
    recs, skipped = load_records(paths["prompts"], id_field="id")
    assert skipped == 0 and len(recs) == 16 and recs[0].prompt_id == "prompts-0"
    assert recs[0].prompt.endswith("now? ") and recs[0].answer.isdigit()
    held, _ = load_records(paths["heldout"], id_field="id")
    assert not {r.prompt for r in held} & {r.prompt for r in recs}


def test_sft_warm_start_on_the_sft_split_lowers_the_loss(tmp_path, sets):
    pytest.importorskip("torch")
    from laminar.models.tiny import build_tiny_model
    from laminar.tasks.warmstart import warm_start
    model = build_tiny_model(tmp_path / "m", hidden=32, layers=1, intermediate=64)
    out = warm_start(model, steps=30, batch=8, lr=1e-2, sft=sets["sft"], log_every=0)
    assert out["loss_last"] < out["loss_first"]
    assert (model / "config.json").exists()


def test_each_step_quotes_its_change_in_the_prompts_order(sets):
    for r in sets["heldout"] + sets["prompts"][:200]:
        quoted = re.findall(r"(gets|loses) (\d+): (\d+) ([+-]) (\d+) = ", r["solution"])
        said = re.findall(r"(gets|loses) (\d+)", r["prompt"])
        assert [(w, x) for w, x, *_ in quoted] == said
        assert all((op == "+") == (w == "gets") and b == x for w, x, _, op, b in quoted)


def test_the_warm_starts_cosine_schedule_warms_up_then_decays_to_a_floor():
    from laminar.tasks.warmstart import lr_factor
    f = [lr_factor(s, 600, "cosine") for s in range(600)]
    assert f[0] == pytest.approx(1 / 30) and f[29] == pytest.approx(1.0)  # 5% of the steps warm up
    assert all(a >= b for a, b in zip(f[29:], f[30:], strict=False))      # then it only decays
    assert f[-1] == pytest.approx(0.05, abs=1e-3)
    assert {lr_factor(s, 600, "constant") for s in range(600)} == {1.0}
    with pytest.raises(ValueError):
        lr_factor(0, 600, "linear")


def test_the_sft_warm_start_uses_a_model_folders_own_tokenizer(tmp_path, sets):
    """SmolLM2's warm start: a folder with a tokenizer is tuned on its tokens (prompts as the
    prompt pool encodes them, the reply ended by the tokenizer's EOS, no BOS inside it)."""
    pytest.importorskip("torch")
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    from laminar.datasets import HFTokenizer, load_tokenizer
    from laminar.models.tiny import build_tiny_model
    from laminar.tasks.warmstart import _reply_ids, warm_start
    model = build_tiny_model(tmp_path / "m", hidden=32, layers=1, intermediate=64)
    chars = sorted({c for r in sets["sft"][:50] for c in r["prompt"] + r["solution"]})
    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                            unk_token="<unk>", pad_token="<|im_end|>").save_pretrained(model)
    t = load_tokenizer(str(model))
    assert isinstance(t, HFTokenizer) and t.eos_id == 2
    ids = _reply_ids(t, "4 + 8 = 12.")
    assert ids[-1] == 2 and 1 not in ids and ids[:-1] == t.tok.encode("4 + 8 = 12.", add_special_tokens=False)
    assert len(ids) > 5
    out = warm_start(model, steps=20, batch=4, lr=1e-2, sft=sets["sft"][:50], log_every=0)
    assert out["loss_last"] < out["loss_first"]
    with pytest.raises(ValueError, match="byte-level"):
        warm_start(model, steps=1, batch=1)  # the uppercase warm start is for the byte-level model only


def test_a_solution_stopped_early_boxes_the_total_one_step_short(sets):
    """The demo's warm start (`--stop-early F`) teaches a policy that often answers too soon: the
    cut solution keeps every step but the last, each still right, and boxes the running total
    before it (for a one-step problem, the starting number), so its reward is 0."""
    from laminar.tasks.warmstart import stopped_early
    for r in sets["heldout"]:
        cut = stopped_early(r)
        steps = STEP.findall(cut)
        assert len(steps) == r["steps"] - 1
        assert steps == STEP.findall(r["solution"])[:-1]
        start = re.search(r"has (\d+) ", r["prompt"]).group(1)
        assert cut.endswith(f"\\boxed{{{steps[-1][3] if steps else start}}}")
        assert math_score(cut, r["answer"]) == (1.0 if r["answer"] == (steps[-1][3] if steps else start) else 0.0)
    with pytest.raises(ValueError, match="not a word-problem solution"):
        stopped_early({"solution": "\\boxed{3}", "prompt": "x"})


def test_the_warm_start_mixes_in_early_answers_at_the_rate_asked(tmp_path, sets, monkeypatch):
    pytest.importorskip("torch")
    from laminar.models.tiny import build_tiny_model
    from laminar.tasks import warmstart
    replies, cut = [], []
    real_reply, real_cut = warmstart._reply_ids, warmstart.stopped_early
    monkeypatch.setattr(warmstart, "_reply_ids", lambda tok, text: replies.append(text) or real_reply(tok, text))
    monkeypatch.setattr(warmstart, "stopped_early", lambda rec: cut.append(real_cut(rec)) or cut[-1])
    model = build_tiny_model(tmp_path / "m", hidden=32, layers=1, intermediate=64)
    warmstart.warm_start(model, steps=10, batch=40, lr=1e-2, sft=sets["sft"], log_every=0, stop_early=0.6)
    assert len(replies) == 400 and 0.5 < len(cut) / 400 < 0.7, len(cut)
    assert all(c in replies for c in cut)           # what was cut is what was trained on
    replies.clear()
    n_cut = len(cut)
    warmstart.warm_start(model, steps=2, batch=8, lr=1e-2, sft=sets["sft"], log_every=0)
    assert len(replies) == 16 and len(cut) == n_cut  # the default: no early answers
