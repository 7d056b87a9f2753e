"""An exported folder loads in the vLLM CPU engine and gives the trainer's greedy tokens.

vLLM runs in a child process (in-process engine core there), so its threads and environment stay
out of the test process. Heavy (an engine start): run it under the heavy lock."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from laminar.roles.trainer.config import TrainerConfig  # noqa: E402
from laminar.roles.trainer.engine import TrainEngine  # noqa: E402

from laminar.export import export  # noqa: E402
from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.testing.trainer_task import random_groups  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]

PROMPTS = [[1, 40, 41, 42, 43], [1, 100, 7, 250, 9, 12], [1, 5]]
NEW = 12

CHILD = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
          max_model_len=256, max_num_seqs=4)
sp = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[2]), detokenize=False, ignore_eos=True)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in json.loads(sys.argv[3])], sp)
print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def test_exported_folder_gives_the_trainers_greedy_tokens_in_vllm(tmp_path):
    base = build_tiny_model(tmp_path / "base", seed=0, init_std=0.5)
    cfg = TrainerConfig(model_dir=str(base), optimizer={"lr": 1e-2}, logging={"mismatch_previous_version": False})
    eng = TrainEngine(cfg, 0, torch.device("cpu"))
    eng.load()
    eng.train(random_groups(2, 4, "vx"), 1)
    from laminar.roles.trainer import checkpoint
    ckpt = checkpoint.save(tmp_path / "ckpts", 1, {"model": eng.models.model.state_dict()}, {"cursor": 0})
    out = export(ckpt, tmp_path / "hf", base)
    model = eng.models.model.eval()
    want = []
    with torch.no_grad():
        for p in PROMPTS:
            g = model.generate(
                torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None
            )
            want.append(g[0, len(p):].tolist())
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    r = subprocess.run([sys.executable, "-c", CHILD, str(out), str(NEW), json.dumps(PROMPTS)], env=env,
                       capture_output=True, text=True, timeout=540)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("TOKENS ")), None)
    assert r.returncode == 0 and line, r.stderr[-3000:]
    assert json.loads(line[len("TOKENS "):]) == want
