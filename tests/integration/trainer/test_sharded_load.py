"""Sharded load (roles/trainer/sharded_load.py): gloo ranks on the CPU build the model on the meta
device, shard it (layers, embeddings and head as FSDP2 units of their own; one unit when tied), and
each reads only its own rows from the safetensors files.

- every rank's piece of every parameter is exactly its rows of the file's tensor (cast to the
  parameter's dtype: a bf16 file into fp32 master weights; the LoRA base kept in bf16), the pieces
  cover every row once, a tied head stays the embedding's parameter;
- a LoRA adapter made on the meta base: A the same on 1 and 2 ranks (drawn whole from a generator
  seeded alike), B zero;
- training from the sharded load equals training from the old full load, bit for bit;
- each rank's peak memory during the load is about its share, where the full load's is the model.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from laminar.testing.load_ranks import launch_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def build(path: Path, tied: bool, dtype: str = "float32", hidden: int = 64, layers: int = 2, vocab: int = 301,
          intermediate: int = 96, shard_size: str | None = None) -> Path:
    import transformers
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   tie_word_embeddings=tied, max_position_embeddings=512)
    torch.manual_seed(1)
    model = transformers.Qwen2ForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(path, **({"max_shard_size": shard_size} if shard_size else {}))
    return path


def file_tensors(model_dir: Path) -> dict:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def run(model_dir: Path, out: Path, world: int, *flags: str) -> list[dict]:
    launch_ranks("laminar.testing.load_ranks", world, [str(model_dir), str(out), *flags], timeout=240)
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(world)]


def file_name(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


@pytest.mark.parametrize("tied, shard_size", [(True, None), (False, "40KB")], ids=["tied", "untied-index"])
def test_sharded_load_reads_each_ranks_rows(tmp_path, tied, shard_size):
    """(untied-index: the checkpoint in several files and their index, as big models are saved)"""
    d = build(tmp_path / "m", tied, dtype="bfloat16", shard_size=shard_size)  # bf16 files, fp32 master weights
    if shard_size:
        assert (d / "model.safetensors.index.json").is_file() and len(list(d.glob("*.safetensors"))) > 2
    infos = run(d, tmp_path / "out", 2, "--pieces")
    files = file_tensors(d)
    pieces = [torch.load(f"{tmp_path / 'out'}.{r}.pt") for r in range(2)]
    assert set(pieces[0]) == set(pieces[1])
    for name in pieces[0]:
        key = name if name in files else "model.embed_tokens.weight"  # a tied head is the embedding
        full = files[key].float()
        rows = torch.cat([p[name][1] for p in sorted(pieces, key=lambda p: p[name][0])])
        assert pieces[0][name][1].dtype == torch.float32, name
        assert torch.equal(rows, full), name  # every row once, in order, exact
    for info in infos:
        assert info["tied"] is tied
        assert {"model.embed_tokens", "lm_head"} <= set(info["units"]), info["units"]
        assert {"model.layers.0", "model.layers.1", ""} <= set(info["units"])
        assert info["report"]["unused_tensors"] == 0
    if tied:
        assert "lm_head.weight" not in pieces[0]  # one parameter (one unit of both modules)
    print(f"\nunits: {infos[0]['units']}; rank 0 read {infos[0]['report']['bytes_read']} bytes")


def test_sharded_load_lora_base_and_adapter(tmp_path):
    d = build(tmp_path / "m", tied=True)
    run(d, tmp_path / "one", 1, "--pieces", "--lora", "--dtype", "bfloat16")
    run(d, tmp_path / "two", 2, "--pieces", "--lora", "--dtype", "bfloat16")
    one = torch.load(f"{tmp_path / 'one'}.0.pt")
    two = [torch.load(f"{tmp_path / 'two'}.{r}.pt") for r in range(2)]
    files = file_tensors(d)
    adapter = [n for n in one if "lora_" in n]
    assert adapter and any("lora_A" in n for n in adapter)
    for name, (_, full) in one.items():
        rows = torch.cat([p[name][1] for p in sorted(two, key=lambda p: p[name][0])])
        assert torch.equal(rows, full), name
        if "lora_" in name:
            assert full.dtype == torch.float32
            assert bool((full == 0).all()) == ("lora_B" in name), name
        else:
            assert full.dtype == torch.bfloat16, name
            assert torch.equal(full, files[file_name(name)].to(torch.bfloat16)), name


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_sharded_load_trains_as_the_full_load(tmp_path, tiny, algorithm):
    """2 ranks: the sharded load and the old full load train the same long-tailed batches to the
    same weights and metrics, exactly (PPO: its critic loaded sharded too, value head zero)."""
    variants = [{"distributed": {"sharded_load": False}, "performance": {"micro_batch_size": 2}},
                {"distributed": {"sharded_load": True}, "performance": {"micro_batch_size": 2}}]
    out = tmp_path / "v.pt"
    launch_ranks("laminar.testing.trainer_ranks", 2, [str(tiny), str(out), "--variants", json.dumps(variants),
                                                      "--algorithm", algorithm], timeout=240)
    full, sharded = torch.load(out)["variants"]
    keys = ("pg_loss", "loss", "grad_norm", "entropy", "tokens") + (("value_loss",) if algorithm == "ppo" else ())
    for m_f, m_s in zip(full["metrics"], sharded["metrics"], strict=True):
        for k in keys:
            assert m_s[k] == m_f[k], k
    for k, v in full["model"].items():
        assert torch.equal(sharded["model"][k], v), k


def test_sharded_load_peak_memory_is_the_ranks_share(tmp_path):
    """A ~130 MB (fp32) model on 2 ranks: the sharded load's peak per rank is well under the model's
    bytes (its half, plus one tensor in flight); the full load's is at least the whole model."""
    d = build(tmp_path / "m", tied=False, hidden=512, layers=8, vocab=4096, intermediate=2048)
    model_bytes = sum(t.numel() * 4 for t in file_tensors(d).values())
    env = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    launch_ranks("laminar.testing.load_ranks", 2, [str(d), str(tmp_path / "s"), "--mode", "sharded"], 240, env)
    launch_ranks("laminar.testing.load_ranks", 2, [str(d), str(tmp_path / "f"), "--mode", "full"], 240, env)
    sharded = [json.loads(Path(f"{tmp_path / 's'}.{r}.json").read_text()) for r in range(2)]
    full = [json.loads(Path(f"{tmp_path / 'f'}.{r}.json").read_text()) for r in range(2)]
    for s, f in zip(sharded, full, strict=True):
        assert s["report"]["local_bytes"] == pytest.approx(model_bytes / 2, rel=0.02)
        assert s["report"]["peak_bytes"] < 0.7 * model_bytes, (s["report"], model_bytes)
        assert f["report"]["peak_bytes"] >= model_bytes, (f["report"], model_bytes)
    print(f"\nmodel {model_bytes / 2**20:.0f} MiB; peak per rank: sharded "
          f"{[round(s['report']['peak_bytes'] / 2**20) for s in sharded]} MiB, full "
          f"{[round(f['report']['peak_bytes'] / 2**20) for f in full]} MiB")


def test_sharded_load_falls_back_when_the_files_name_tensors_otherwise(tmp_path):
    """A mixture of experts whose files hold one tensor per expert where the model has fused expert
    tensors (transformers converts them as it loads): the sharded load cannot read rows by name, so
    the model loads the old way, the report saying which tensor the files lack; a dense model's
    files hold every parameter by name."""
    from laminar.roles.trainer.dist import DistInfo
    from laminar.roles.trainer.sharded_load import build_on_meta, load_model, missing_in_files

    from laminar.models.tiny import build_tiny_moe_model
    dense = build(tmp_path / "dense", tied=True)
    assert missing_in_files(build_on_meta(dense), dense) is None
    moe = build_tiny_moe_model(tmp_path / "moe", seed=0)
    missing = missing_in_files(build_on_meta(moe), moe)
    assert missing is not None and ".experts." in missing, missing
    model, report = load_model(moe, torch.device("cpu"), DistInfo())
    assert report.peak_kind.endswith(f"full load: the files lack {missing} by that name")
    assert all(p.device.type == "cpu" for p in model.parameters())
