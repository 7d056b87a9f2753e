"""Hugging Face export: the trainer's weights after a training step, written as a folder that
transformers loads with the same weights and the same greedy tokens as the trainer's model."""
from __future__ import annotations

import json
import shutil
import uuid

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from laminar.roles.trainer import checkpoint  # noqa: E402
from laminar.roles.trainer.config import TrainerConfig  # noqa: E402
from laminar.roles.trainer.engine import TrainEngine  # noqa: E402

from laminar.export import export, main  # noqa: E402
from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.testing.trainer_task import random_groups  # noqa: E402

PROMPTS = [[1, 40, 41, 42, 43], [1, 100, 7, 250, 9, 12], [1, 5]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model (varied greedy outputs), one GRPO step on it, and its checkpoint."""
    root = tmp_path_factory.mktemp("export")
    base = build_tiny_model(root / "base", seed=0, init_std=0.5)
    (base / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 2048}))  # copied along
    cfg = TrainerConfig(model_dir=str(base), optimizer={"lr": 1e-2}, logging={"mismatch_previous_version": False})
    eng = TrainEngine(cfg, 0, torch.device("cpu"))
    eng.load()
    eng.train(random_groups(2, 4, "ex"), 1)
    ckpts = root / "ckpts"
    checkpoint.save(ckpts, 1, {"model": eng.models.model.state_dict()}, {"cursor": 0})
    return base, ckpts, eng.models.model.eval()


def greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_export_of_a_checkpoint_loads_in_transformers_with_the_trainers_greedy_tokens(trained, tmp_path):
    base, ckpts, model = trained
    out = export(ckpts, tmp_path / "hf", base)  # a folder of checkpoints: its newest
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()
    assert json.loads((out / "laminar_version.json").read_text())["version"] == 1
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    trained_sd = model.state_dict()
    assert all(torch.equal(t, trained_sd[k]) for k, t in loaded.state_dict().items())
    original = transformers.AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    assert not torch.equal(original.state_dict()["model.norm.weight"], trained_sd["model.norm.weight"])
    for p in PROMPTS:
        assert greedy(loaded, p) == greedy(model, p)
    assert not list(tmp_path.glob(".tmp-*"))


def test_bf16_export_is_the_cast_weights_and_names_its_dtype(trained, tmp_path):
    base, ckpts, model = trained
    out = tmp_path / "hf16"
    assert main([str(checkpoint.latest(ckpts)), str(out), "--model-dir", str(base), "--dtype", "bfloat16"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg.get("dtype") or cfg.get("torch_dtype")) == "bfloat16"
    from safetensors.torch import load_file
    stored = load_file(out / "model.safetensors")
    want = model.state_dict()
    assert stored and all(
        t.dtype == torch.bfloat16 and torch.equal(t, want[k].to(torch.bfloat16)) for k, t in stored.items()
    )
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert loaded.dtype == torch.bfloat16


def test_export_from_a_relay_folder_takes_the_version_the_rollouts_load(trained, tmp_path):
    from laminar.weights.local_write import write_version
    from laminar.weights.store import ShmStore
    base, _, model = trained
    store = ShmStore(f"/dev/shm/laminar-unit-{uuid.uuid4().hex[:10]}")
    try:
        store.open()
        write_version(store, model.state_dict(), 7, chunk_bytes=64 << 10)
        out = export(store.dir, tmp_path / "hf", base, dtype="same")
    finally:
        store.close()
        store.remove_files()
        shutil.rmtree(store.dir, ignore_errors=True)
    assert json.loads((out / "laminar_version.json").read_text())["version"] == 7
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert greedy(loaded, PROMPTS[0]) == greedy(model, PROMPTS[0])


def test_a_source_that_holds_no_weights_is_a_named_error(trained, tmp_path):
    base, _, _ = trained
    with pytest.raises(FileNotFoundError, match="neither a checkpoint"):
        export(tmp_path, tmp_path / "out", base)


def test_laminar_node_export_subcommand(trained, tmp_path):
    from laminar.cli import main as node_main
    base, ckpts, model = trained
    assert node_main(["export", str(ckpts), str(tmp_path / "hf"), "--model-dir", str(base)]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    assert greedy(loaded, PROMPTS[1]) == greedy(model, PROMPTS[1])


def test_export_never_deletes_an_existing_folder(trained, tmp_path):
    """Before: an existing OUT_DIR was removed without a word (exit 0, the user's file gone)."""
    from laminar.cli import main as node_main
    base, ckpts, _ = trained
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert node_main(["export", str(ckpts), str(out), "--model-dir", str(base)]) == 2
    assert (out / "notes.txt").read_text() == "keep me" and not (out / "config.json").exists()
    assert node_main(["export", str(ckpts), str(out), "--model-dir", str(base), "--force"]) == 0
    assert (out / "config.json").exists()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("hf.")]
    assert len(aside) == 1 and (aside[0] / "notes.txt").read_text() == "keep me"


def test_export_without_a_model_dir_is_a_usage_error(tmp_path, capsys):
    from laminar.cli import main as node_main
    assert node_main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "--model-dir is needed" in capsys.readouterr().err
