"""bench/reward_cost.py writes `per_length: {tokens: {median_s, p99_s}}` for responses of the
asked lengths, built from the word-problem generator in DAPO's format, and checks that each
response scores as its answer kind says (right in the reference's form, right in another form,
wrong). Runs with a small byte-level BPE tokenizer trained here, so it needs no model download
(the committed measurement used SmolLM2's: `make models/smollm2/config.json`)."""
from __future__ import annotations

import json
import random
import subprocess
import sys

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from tokenizers import decoders as tok_decoders

from laminar.tasks.word_problems import problem
from tests.support import ROOT


def small_tokenizer(folder) -> None:
    rng = random.Random(0)
    text = [problem(rng)["solution"] + " $\\frac{2 \\cdot 3}{2}$ \\boxed{7} Answer: 12" for _ in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tok_decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def test_reward_cost_writes_median_and_p99_per_length(tmp_path):
    small_tokenizer(tmp_path / "tok")
    out = tmp_path / "cost.json"
    subprocess.run([sys.executable, "bench/reward_cost.py", "--model-dir", str(tmp_path / "tok"), "--samples", "6",
                    "--lengths", "500,2000", "--out", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=300)
    got = json.loads(out.read_text())
    assert set(got["per_length"]) == {"500", "2000"}
    for part in ("per_length", "detokenize", "verify"):
        for n, row in got[part].items():
            assert row["samples"] == 6 and row["tokens_mean"] == int(n)
            assert 0 < row["median_s"] <= row["p99_s"] and 0 < row["cpu_median_s"] <= row["cpu_p99_s"]
    assert set(got["by_answer"]["500"]) == {"exact", "other_form", "wrong"}
    assert got["answer_mix"] == {"exact": 1 / 3, "other_form": 1 / 6, "wrong": 1 / 2}
