"""The memory plan (laminar/memory_plan.py): its arithmetic on a hand-computed shape, the shipped
Qwen2.5 shape files against the published parameter counts, the three GPU recipes at 80 GiB,
the 72B recipe refused with rollouts at TP=1 (naming the GiB), a GPU two placements share, and
the command's exit status."""
from __future__ import annotations

import json
import re
import types
from pathlib import Path

import pytest
import yaml
from laminar.roles.trainer.config import LoraSettings, TrainerConfig

from laminar.config import load_config, parse_config
from laminar.memory_plan import GiB, check_memory, lora_params, main, plan_memory, rollout_plan, trainer_plan
from laminar.models.shape import model_shape, shape_from_config
from tests.support import ROOT

RECIPES = [ROOT / "configs" / f"gpu-{m}.yaml" for m in ("7b", "32b", "72b", "72b-64")]
# A shape small enough to count by hand: 2 layers, hidden 64, MLP 128, 4 query heads and 2 KV
# heads of 16, vocabulary 100, untied head, q/k/v biases (Qwen2).
HAND = {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": False,
        "max_position_embeddings": 4096}


def test_memory_plan_shape_counts_by_hand():
    s = shape_from_config(HAND)
    # q: 64x64, k and v: 64x32 each, o: 64x64, biases 64+32+32 -> 12,416; MLP 3 x 64 x 128 = 24,576; norms 128
    assert s.layer_params == 12_416 + 24_576 + 128 == 37_120
    assert s.embed_params == 100 * 64 * 2 + 64 == 12_864  # embeddings + head + final norm
    assert s.params == 2 * 37_120 + 12_864 == 87_104
    assert s.kv_bytes_per_token(2) == 2 * 2 * 2 * 16 * 2 == 256  # K and V x layers x KV heads x head_dim x bf16
    assert s.kv_bytes_per_token(2, tp=2) == 128 and s.kv_bytes_per_token(2, tp=4) == 128  # 1 head per rank, at least
    assert s.tp_problem(2) is None and s.tp_problem(4) is None
    assert "3 does not divide the model's 4 attention heads" in s.tp_problem(3)
    assert s.tp_problem(8) == "8 does not divide the model's 4 attention heads"


def test_memory_plan_trainer_items_by_hand():
    s = shape_from_config(HAND)
    t = TrainerConfig(model_dir="m", distributed={"world_size": 2}, logging={"mismatch_previous_version": False},
                      performance={"dtype": "bfloat16", "micro_batch_size": 1, "activation_checkpointing": True,
                                   "logprob_chunk_tokens": 32})
    items = trainer_plan(s, t, max_model_len=256)
    assert items["parameters (fp32 shard)"] == 4 * 87_104 / 2 == 174_208
    assert items["gradients (fp32 shard)"] == 174_208
    assert items["Adam m, v (fp32 shards)"] == 348_416
    assert items["gathered layers (2) + one layer's gradients"] == 37_120 * (2 * 2 + 2 + 4) == 371_200
    # untied: the head (or the embeddings), each a unit: bf16 weight + float32 gradient + its bf16 cast
    assert items["gathered head (or embeddings: a unit each) + its gradient"] == 100 * 64 * (2 + 4 + 2) == 51_200
    # per token and layer (flash-attention on a GPU): 4 x 64 + 3 x 64 (q) + 2 x 32 (k, v) + 4 x 128 = 1,024
    # values of 2 bytes; checkpointed: every layer's input (2 x 256 x 64 x 2 B) + one layer recomputed
    assert items["activations (256 tokens, checkpointed)"] == 2 * 256 * 64 * 2 + 256 * 1_024 * 2 == 589_824
    assert items["logits (32 tokens x 100)"] == 32 * 100 * (8 + 2) == 32_000
    assert sum(items.values()) == 174_208 * 2 + 348_416 + 371_200 + 51_200 + 589_824 + 32_000 + 3 * GiB
    t.performance.activation_checkpointing, t.performance.logprob_chunk_tokens = False, 0  # all layers; full logits
    items = trainer_plan(s, t, max_model_len=256)
    # every layer's values, plus the embedding's output and the final norm's input and output (3 x 64)
    assert items["activations (256 tokens)"] == 2 * 256 * 1_024 * 2 + 256 * 3 * 64 * 2
    assert items["logits (256 tokens x 100)"] == 256 * 100 * 14


def test_memory_plan_context_parallel_by_hand():
    """Context parallelism 2: each rank's activations and logits are those of half the tokens, plus
    one layer's all-to-all buffers; a dense kernel on the CPU (sdpa) adds repeated keys and values and,
    for rows of several sequences, a float32 mask over the whole row."""
    s = shape_from_config(HAND)
    t = TrainerConfig(model_dir="m", distributed={"world_size": 2, "context_parallel_size": 2},
                      logging={"mismatch_previous_version": False},
                      performance={"dtype": "bfloat16", "micro_batch_size": 1, "activation_checkpointing": True,
                                   "logprob_chunk_tokens": 32})
    items = trainer_plan(s, t, max_model_len=256)
    assert items["activations (128 tokens of 256, context parallel 2, checkpointed)"] == \
        2 * 128 * 64 * 2 + 128 * 1_024 * 2
    assert items["all-to-all buffers (one layer's q, k, v)"] == 2 * 128 * (4 + 2 * 2) * 16 * 2
    assert items["logits (32 tokens x 100)"] == 32_000
    t.device = "cpu"
    t.performance.packing, t.performance.micro_batch_size, t.performance.dtype = True, 2, "float32"
    items = trainer_plan(s, t, max_model_len=256)
    # dense: q, keys and values repeated to 4 heads, output and o_proj input: 5 x 64; 512 tokens a micro-batch
    assert items["activations (256 tokens of 512, context parallel 2, checkpointed)"] == \
        2 * 256 * 64 * 4 + 256 * (4 * 64 + 5 * 64 + 4 * 128) * 4
    assert items["attention masks (1 x 512^2, float32)"] == 512 * 512 * 4


def test_memory_plan_lora_by_hand():
    """LoRA: the frozen base in its dtype, the adapter (r x (in + out) per target) with float32
    gradients and Adam's states; no reference copy (the adapter off), no base gradients gathered."""
    s = shape_from_config(HAND)
    lora = LoraSettings(rank=4, base_dtype="bfloat16")  # every linear layer by default
    # per layer: q 64+64, k 64+32, v 64+32, o 64+64, gate/up/down 64+128 each, times r = 4
    assert lora_params(s, lora) == 2 * 4 * (128 + 96 + 96 + 128 + 3 * 192) == 8_192
    t = TrainerConfig(model_dir="m", distributed={"world_size": 2}, logging={"mismatch_previous_version": False},
                      performance={"dtype": "bfloat16", "micro_batch_size": 1, "activation_checkpointing": True,
                                   "logprob_chunk_tokens": 32}, loss={"kl_coef": 0.1}, lora=lora)
    items = trainer_plan(s, t, max_model_len=256)
    assert items["base (frozen, bfloat16 shard)"] == 87_104 * 2 / 2
    assert items["LoRA adapter + gradients + Adam (fp32 shards)"] == 16 * 8_192 / 2
    assert not any(k.startswith("reference") for k in items)
    assert items["gathered layers (2)"] == 2 * 37_120 * 2
    assert items["gathered head (or embeddings: a unit each)"] == 100 * 64 * 2


def test_memory_plan_rollout_items_by_hand():
    s = shape_from_config(HAND)
    r = types.SimpleNamespace(tensor_parallel_size=2, dtype="bfloat16")
    items, kv = rollout_plan(s, r, max_num_seqs=4)
    assert items["weights (bfloat16) / TP 2"] == 87_104 * 2 / 2
    # per token and layer at TP 2: 4 x 64 + 3 x 32 (q) + 3 x 16 (1 KV head) + 4 x 64 = 656 values
    assert items["activations (8192-token step)"] == 8192 * 656 * 2
    assert items["sampler logits (4 seqs, fp32)"] == 4 * 100 * 8
    assert kv == 128


def test_memory_plan_shipped_shapes_match_the_published_sizes():
    published = {"7B": 7.62e9, "32B": 32.76e9, "72B": 72.71e9}  # the models' cards / safetensors totals
    for name, n in published.items():
        s = model_shape(f"models/Qwen2.5-{name}-Instruct")  # no such folder here: the shipped shape file
        assert s is not None and s.source.endswith(f"configs/models/Qwen2.5-{name}-Instruct/config.json")
        assert abs(s.params - n) / n < 0.005, (name, s.params)
        assert s.vocab == 152_064 and s.max_positions == 32_768


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_memory_plan_recipes_fit_80_gib_with_chunked_logprobs(path):
    """Every rank and rollout of the recipe within 80 GiB, the trainer computing logprobs 1,024
    tokens at a time (the trainer's performance.logprob_chunk_tokens); and check_memory agrees."""
    cfg = load_config(path)
    plans = plan_memory(cfg, 80)
    assert {p.kind for p in plans} == {"trainer", "rollout"}
    for p in plans:
        if p.kind == "rollout":
            assert p.problem is None, p.problem
            continue
        t = cfg.settings_of("trainer", p.key.split(".")[1])
        chunked = t.model_copy(update={"performance": t.performance.model_copy(update={"logprob_chunk_tokens": 1024})})
        need = sum(trainer_plan(model_shape(t.model_dir), chunked, 18_432).values())
        assert need <= 80 * GiB, f"{p.key}: {need / GiB:.1f} GiB"
    assert check_memory(cfg, 80) == []


def recipe_72b_at_tp1(tmp_path) -> Path:
    """configs/gpu-72b.yaml with every rollout on one GPU at tensor_parallel_size 1."""
    data = yaml.safe_load((ROOT / "configs" / "gpu-72b.yaml").read_text())
    data["roles"]["rollout"]["tensor_parallel_size"] = 1
    for host in data["cluster"]["hosts"].values():
        for spec in host["roles"]:
            if spec["role"] == "rollout":
                spec["gpus"] = spec["gpus"][:1]
    path = tmp_path / "gpu-72b-tp1.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_memory_plan_refuses_72b_rollouts_at_tp1_naming_the_gib(tmp_path, capsys):
    path = recipe_72b_at_tp1(tmp_path)
    problems = [p for p in check_memory(load_config(path), 80) if p.startswith("rollout.")]
    assert len(problems) == 1 and "(and 7 more alike" in problems[0]  # the 8 rollouts, folded
    # 72,706,203,648 parameters x 2 bytes = 135.4 GiB on one GPU, where vLLM may use 0.9 x 80 = 72 GiB
    assert "weights 135.4 GiB / TP 1 = 135.4 GiB" in problems[0] and "has 72.0 GiB" in problems[0]
    assert main([str(path), "--gpu-memory-gib", "80"]) == 2
    assert "does not fit: rollout.0 on n8" in capsys.readouterr().err


def test_memory_plan_a_shared_gpu_must_hold_both(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(HAND))
    roles = [{"role": "trainer", "port": 5590, "gpus": [0]}, {"role": "rollout", "port": 5580, "gpus": [0]}]
    cfg = parse_config({"cluster": {"keys_dir": None, "broker": {"host": "h"},
                                    "hosts": {"h": {"address": "127.0.0.1", "roles": roles}}},
                        "roles": {"trainer": {"model_dir": str(model)},
                                  "rollout": {"model_dir": str(model), "gpu_memory_utilization": 0.9}}})
    problems = check_memory(cfg, 8)  # the trainer's ~3 GiB + the rollout's 0.9 x 8 GiB > 8 GiB
    assert problems and "GPU 0 of h is shared by trainer.0, rollout.0" in problems[0]
    half = cfg.model_copy(update={"roles": {**cfg.roles, "rollout": {"model_dir": str(model),
                                                                     "gpu_memory_utilization": 0.5}}})
    assert check_memory(half, 8) == []  # ~3 GiB + 4 GiB


def test_memory_plan_command_prints_the_plan_and_exits_0_when_it_fits(tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(HAND))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "cluster": {"keys_dir": None, "broker": {"host": "h"}, "hosts": {"h": {"address": "127.0.0.1", "roles": [
            {"role": "rollout", "port": 5580, "gpus": [0, 1]}]}}},
        "roles": {"rollout": {"model_dir": str(model), "tensor_parallel_size": 2}}}))
    assert main([str(path), "--gpu-memory-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "rollout.0: 72.0 GiB of 72.0 GiB per GPU, fits" in out and "weights (float32) / TP 2" in out


def recipe(tmp_path, name: str, cp: int, **rollout) -> Path:
    """configs/<name>.yaml with the trainer's context_parallel_size set to `cp` (and rollout settings)."""
    data = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    data["roles"]["trainer"].setdefault("distributed", {})["context_parallel_size"] = cp
    data["roles"]["rollout"].update(rollout)
    if rollout.get("max_model_len", 0) > 32_768:  # 32K-token responses: the folder with YaRN's rope scaling
        for role in ("trainer", "rollout"):
            data["roles"][role]["model_dir"] = "models/Qwen2.5-72B-Instruct-YaRN"
        data["roles"]["prompt_pool"]["max_tokens"] = rollout["max_model_len"] - 2048
    path = tmp_path / f"{name}-cp{cp}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_memory_plan_72b_at_64_gpus_needs_context_parallelism(tmp_path, capsys):
    """The paper's 64-GPU placement of 72B (32 trainer ranks): `laminar-node check` accepts it at
    context_parallel_size 2 (what the recipe sets) and refuses it without, naming the GiB."""
    from laminar.cli import main as cli
    path = ROOT / "configs" / "gpu-72b-64.yaml"
    assert cli(["check", str(path), "--gpu-memory-gib", "80"]) == 0
    capsys.readouterr()
    assert cli(["check", str(path), "--gpu-memory-gib", "80",
                "--set", "roles.trainer.distributed.context_parallel_size=1"]) != 0
    said = "".join(capsys.readouterr())
    assert re.search(r"trainer\.0 on n0 \(GPU 0\): needs 8\d\.\d GiB of the GPU's 80\.0 GiB", said), said
    assert load_config(path).settings_of("trainer").distributed.context_parallel_size == 2
    problems = check_memory(load_config(recipe(tmp_path, "gpu-72b-64", 1)), 80)
    assert len(problems) == 1 and "(and 31 more alike" in problems[0], problems
    assert re.search(r"trainer\.0 on n0 \(GPU 0\): needs (8[0-9]\.\d) GiB of the GPU's 80\.0 GiB", problems[0])
    assert "activations (18432 tokens, checkpointed) 28.6" in problems[0]


@pytest.mark.parametrize("name, cp", [("gpu-72b", 2), ("gpu-72b-64", 4)])
def test_memory_plan_72b_32k_responses_with_context_parallelism(tmp_path, name, cp):
    """72B with 32,768-token responses (34,816-token sequences, YaRN positions): accepted with
    context parallelism (2 at 64 trainer ranks, 4 at 32), refused at half of it, naming the GiB."""
    assert check_memory(load_config(recipe(tmp_path, name, cp, max_model_len=34_816)), 80) == []
    problems = check_memory(load_config(recipe(tmp_path, name, cp // 2, max_model_len=34_816)), 80)
    assert problems and all(p.startswith("trainer.") for p in problems), problems
    assert re.search(r"needs \d+\.\d GiB of the GPU's 80\.0 GiB \(activations \((34816|17408) tokens", problems[0])
