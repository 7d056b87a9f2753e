"""`laminar-node eval` gives the evaluator role's numbers: the role (a real process, its vLLM CPU
engine) evaluates version 0 from its model folder and version 3 from a relay folder; then the
command evaluates the same relay folder, and the Hugging Face folder `laminar-node export` makes of
that version, and both report exactly the role's numbers for version 3, every interval included."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from tests.support import ROOT

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.tasks.word_problems import write as write_problems  # noqa: E402
from laminar.testing.procs import free_port  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]
CLI = [sys.executable, "-m", "laminar.cli"]


def first_token_even(spec, response_tokens) -> float:
    """A reward a random tiny model gets right about half the time (so the numbers are not all 0)."""
    return 1.0 if response_tokens and int(response_tokens[0]) % 2 == 0 else 0.0


def perturbed(model: Path) -> dict:
    import transformers
    m = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    sd = {k: (t + 0.05 * torch.randn(t.shape, generator=g)).contiguous() for k, t in m.state_dict().items()}
    if m.config.tie_word_embeddings and "lm_head.weight" in sd:  # tied, as a trainer's weights stay
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def run(args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_eval_cli_gives_the_evaluator_roles_numbers(tmp_path):
    from laminar.weights.local_write import write_version
    from laminar.weights.store import ShmStore
    model = build_tiny_model(tmp_path / "tiny", seed=3)
    data = write_problems(tmp_path / "data", seed=0, sizes={"heldout": 6, "prompts": 0, "sft": 0})
    shm = Path(f"/dev/shm/laminar-test-evalcli-{uuid.uuid4().hex[:8]}")
    store = ShmStore(shm)
    store.open()
    try:
        write_version(store, perturbed(model), 3)
        cfg = tmp_path / "c.yaml"
        cfg.write_text(yaml.safe_dump({
            "run": {"name": "evalcli", "workdir": str(tmp_path / "run")},
            "cluster": {"keys_dir": None, "broker": {"host": "h0", "pub_port": free_port(), "sub_port": free_port()},
                        "hosts": {"h0": {"address": "127.0.0.1", "roles": [{"role": "broker"},
                                                                          {"role": "evaluator", "cores": [0]}]}}},
            "roles": {"evaluator": {
                "sets": {"word": {"dataset": str(data["heldout"]), "k": 3,
                                  "metrics": ["greedy", "avg@3", "pass@2", "maj@3"]}},
                "reward": "tests.integration.evaluator.test_eval_cli:first_token_even", "max_tokens": 12,
                "model_dir": str(model), "max_model_len": 256, "max_concurrency": 32, "kv_cache_tokens": 2048,
                "shm_dir": str(shm), "last_version": 3, "eval_every": 1, "log_samples": 0}}}))
        role = run([*CLI, "role", "evaluator", "--id", "0", str(cfg)])
        assert role.returncode == 0, role.stderr[-3000:]
        evals = [json.loads(x) for x in (tmp_path / "run" / "evaluator" / "metrics.jsonl").read_text().splitlines()]
        assert [int(e["version"]) for e in evals] == [0, 3]
        by_role = {k: v for k, v in evals[-1].items() if k.startswith("eval/") and k != "eval/seconds"}
        assert any(0 < v < 1 for k, v in by_role.items() if k.count("/") == 2), by_role  # not all 0 or 1
        assert all(f"{k}/lo" in by_role for k in by_role if k.count("/") == 2 and "problems" not in k
                   and "response_len" not in k)

        got = {}
        exported = tmp_path / "exported"
        ex = run([*CLI, "export", str(shm), str(exported), "--model-dir", str(model)])
        assert ex.returncode == 0, ex.stderr[-2000:]
        for name, source in (("relay", shm), ("hf", exported)):
            out = tmp_path / f"{name}.json"
            r = run([*CLI, "eval", str(source), "--sets", str(cfg), "--out", str(out)])
            assert r.returncode == 0, r.stderr[-3000:]
            doc = json.loads(out.read_text())
            assert (doc["kind"], doc["version"]) == (name, 3)
            got[name] = {k: v for k, v in doc["values"].items() if k.startswith("eval/") and k != "eval/seconds"}
            assert "95% interval" in r.stdout and "word" in r.stdout
        assert got["relay"] == by_role, (got["relay"], by_role)
        assert got["hf"] == by_role, (got["hf"], by_role)
    finally:
        store.close()
        import shutil
        shutil.rmtree(shm, ignore_errors=True)
