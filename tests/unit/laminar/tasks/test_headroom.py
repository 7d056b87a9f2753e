"""The headroom task (laminar/tasks/headroom.py): a problem of level L takes exactly L steps of
mixed operations, every worked step is right and the exact checker accepts the solution; the
splits are disjoint, sized, balanced over their levels and the held-out files stable when the
others are resized; the checker takes only the last boxed integer."""
from __future__ import annotations

import random
import re
from collections import Counter
from types import SimpleNamespace

import pytest

from laminar.tasks.headroom import answer_of, exact_reward, is_correct, parse_levels, problem, splits, write

STEP = re.compile(r"(?:gets (\d+): (\d+) \+ (\d+) = (\d+)\.|loses (\d+): (\d+) - (\d+) = (\d+)\."
                  r"|buys (\d+) bags of (\d+): (\d+) \* (\d+) = (\d+), (\d+) \+ (\d+) = (\d+)\.)")


def replay(rec: dict) -> int:
    """Walk the worked solution step by step, checking each against the prompt and the arithmetic."""
    total = int(re.search(r"has (\d+) ", rec["prompt"]).group(1))
    steps = STEP.findall(rec["solution"])
    assert len(steps) == rec["level"]
    for s in steps:
        if s[0]:
            x, a, b, c = map(int, s[0:4])
            assert (a, b, c) == (total, x, total + x)
        elif s[4]:
            x, a, b, c = map(int, s[4:8])
            assert (a, b, c) == (total, x, total - x) and c >= 0
        else:
            n, m, n2, m2, p, a, p2, c = map(int, s[8:16])
            assert (n2, m2, p, a, p2, c) == (n, m, n * m, total, n * m, total + n * m)
        total = c
    return total


@pytest.mark.parametrize("level", [1, 2, 5, 9])
def test_headroom_problem_has_level_steps_all_right(level):
    rng = random.Random(level)
    for _ in range(200):
        rec = problem(rng, level)
        assert replay(rec) == int(rec["answer"])
        assert rec["solution"].endswith(f"\\boxed{{{rec['answer']}}}")
        assert is_correct(rec["solution"], rec["answer"])
        assert rec["prompt"].endswith("Put the final answer in \\boxed{}.")
        assert len(re.findall(r"(?:gets|loses) \d+|buys \d+ bags of \d+", rec["prompt"])) == level


def test_headroom_mixes_operations_at_every_level():
    rng = random.Random(0)
    ops = Counter(w for _ in range(300) for w in re.findall(r"(gets|loses|buys)", problem(rng, 4)["solution"]))
    assert all(ops[k] > 100 for k in ("gets", "loses", "buys")), ops


def test_headroom_splits_disjoint_sized_and_balanced():
    s = splits(0, sft_levels=[1, 2], rl_levels=[2, 3], eval_levels=[2, 3, 4], eval_size=64,
               sizes={"prompts": 200, "sft": 100})
    assert {k: len(v) for k, v in s.items()} == {"heldout-d2": 64, "heldout-d3": 64, "heldout-d4": 64,
                                                 "heldout": 64, "prompts": 200, "sft": 100, "beyond": 64}
    texts = [{r["prompt"] for r in v} for v in s.values()]
    assert sum(map(len, texts)) == len(set.union(*texts))      # no prompt in two splits, nor twice in one
    assert {r["level"] for r in s["heldout-d4"]} == {4}
    assert Counter(r["level"] for r in s["prompts"]) == {2: 100, 3: 100}
    assert Counter(r["level"] for r in s["sft"]) == {1: 50, 2: 50}
    assert Counter(r["level"] for r in s["heldout"]) == {2: 32, 3: 32}
    assert Counter(r["level"] for r in s["beyond"]) == {4: 64}          # past every RL level


def test_headroom_held_out_files_stable_under_resizing_and_deterministic():
    a = splits(1, eval_levels=[2, 6], eval_size=32, sizes={"prompts": 10, "sft": 10})
    b = splits(1, eval_levels=[2, 6], eval_size=32, sizes={"prompts": 50, "sft": 5})
    assert a["heldout-d2"] == b["heldout-d2"] and a["heldout-d6"] == b["heldout-d6"] and a["heldout"] == b["heldout"]
    assert a == splits(1, eval_levels=[2, 6], eval_size=32, sizes={"prompts": 10, "sft": 10})


def test_headroom_checker_takes_the_last_boxed_integer_exactly():
    assert answer_of("so \\boxed{1,024}") == "1024" and answer_of("\\boxed{ 7.0 }") == "7"
    assert answer_of("\\boxed{3} then \\boxed{5}") == "5"
    assert answer_of("\\boxed{x = 5}") is None and answer_of("5") is None and answer_of("\\boxed{5.5}") is None
    assert is_correct("\\boxed{42}", "42") and not is_correct("\\boxed{43}", "42") and not is_correct("42", "42")
    spec = SimpleNamespace(answer="12")
    enc = [b + 3 for b in b"a: 5 + 7 = 12. \\boxed{12}"] + [2, 99]   # byte tokens, EOS, trailing junk
    assert exact_reward(spec, enc) == 1.0
    assert exact_reward(spec, [b + 3 for b in b"\\boxed{13}"]) == 0.0


def test_headroom_levels_and_files(tmp_path):
    assert parse_levels("2-4") == [2, 3, 4] and parse_levels("1,3,6-7") == [1, 3, 6, 7]
    with pytest.raises(ValueError):
        parse_levels("0-2")
    with pytest.raises(ValueError):
        problem(random.Random(0), 0)
    from laminar.datasets import load_records
    paths = write(tmp_path, eval_levels=[3, 6], eval_size=8, sizes={"prompts": 8, "sft": 8})
    assert sorted(paths) == ["beyond", "heldout", "heldout-d3", "heldout-d6", "prompts", "sft"]
    records, _ = load_records(paths["heldout-d3"], "prompt", "answer", "id")
    assert len(records) == 8


def test_headroom_sft_frozen_embeddings(tmp_path):
    """The pretrained-model SFT (laminar/tasks/warmstart.py): with gradient checkpointing and frozen
    embeddings `fit` leaves the embeddings (and a tied head) as they were while the layers move,
    and saves the model's use_cache as it was loaded."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from laminar.models.tiny import build_tiny_model
    from laminar.tasks.warmstart import fit
    tiny = build_tiny_model(tmp_path / "m", seed=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    rng = random.Random(0)
    seqs = [[rng.randrange(3, 250) for _ in range(n)] for n in (9, 14, 5)]
    masks = [[0] * 3 + [1] * (len(s) - 3) for s in seqs]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = fit(tiny, lambda: (seqs, masks), steps=3, lr=1e-2, schedule="constant", memory_saving=True,
              freeze_embeddings=True)
    after = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    emb = after.get_input_embeddings().weight
    assert torch.equal(emb, before["model.embed_tokens.weight"])
    moved = [k for k, v in after.state_dict().items() if "embed" not in k and not torch.equal(v, before[k])]
    assert moved and out["steps"] == 3 and after.config.use_cache == model.config.use_cache
