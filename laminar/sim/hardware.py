"""GPU specs, model shapes, and the KV-cache capacity that follows from them.

Design decisions:
- Numbers are vendor datasheet / model-config values, written once here with their source; the
  simulator never tunes them to reproduce a paper figure.
- A model's parameter count is computed from its shapes (embeddings, attention with the Qwen2
  q/k/v biases, SwiGLU MLP, norms, untied LM head) and checked against the model card in the
  tests, so the weight bytes and the FLOP counts (trainer_cost.py) share one source.
- KV capacity is first-principles arithmetic (`kv_capacity_tokens`), not a measured number; it
  ignores activation and CUDA-graph memory unless `overhead_gib_per_gpu` says otherwise (vLLM's
  `gpu_memory_utilization` caps the total the same way, then subtracts what it profiled).
"""
from __future__ import annotations

from dataclasses import dataclass

GiB = 2 ** 30


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float      # dense (no 2:4 sparsity) peak bf16 tensor-core throughput
    hbm_gib: float          # nominal HBM size (the driver reports ~0.5% less)
    hbm_tbps: float         # HBM bandwidth, TB/s
    nvlink_gbps: float      # NVLink bandwidth per GPU, GB/s (the H800's is cut from 900 to 400)
    pcie_gbps: float        # host<->device, PCIe Gen5 x16, GB/s per direction (theoretical)

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib * GiB

    @property
    def peak_flops(self) -> float:
        return self.bf16_tflops * 1e12


# NVIDIA H100 SXM5 datasheet: 989 TFLOPS bf16 dense (1979 with sparsity), 80 GB HBM3, 3.35 TB/s.
# The H800 SXM5 is the same die and memory with NVLink limited to 400 GB/s (export variant).
GPUS: dict[str, GPU] = {
    "H100": GPU("H100", bf16_tflops=989.0, hbm_gib=80.0, hbm_tbps=3.35, nvlink_gbps=900.0, pcie_gbps=64.0),
    "H800": GPU("H800", bf16_tflops=989.0, hbm_gib=80.0, hbm_tbps=3.35, nvlink_gbps=400.0, pcie_gbps=64.0),
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int              # query heads
    kv_heads: int           # grouped-query attention: KV heads
    head_dim: int
    intermediate: int       # SwiGLU MLP width
    vocab: int
    tied_embeddings: bool = False

    @property
    def params(self) -> int:
        """Parameter count from the shapes (Qwen2: q/k/v carry biases, o does not)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = (h * q + q) + 2 * (h * kv + kv) + q * h
        mlp = 3 * h * self.intermediate
        per_layer = attn + mlp + 2 * h                    # + input and post-attention RMSNorm
        embed = self.vocab * h * (1 if self.tied_embeddings else 2)
        return self.layers * per_layer + embed + h        # + final norm

    def attention_flops(self, n: int) -> float:
        """FLOPs of causal self-attention over one sequence of `n` tokens, one forward pass: QK^T
        and AV each multiply-add n²/2 query-key pairs over every query dimension of every layer,
        2 × layers × heads × head_dim × n² in all (the projections are in the 2 × params × n of the
        dense part). 7B at 8,192 tokens: 10.8% of the dense FLOPs; 72B at 1,500: 1.4%."""
        return 2.0 * self.layers * self.heads * self.head_dim * float(n) * float(n)

    def weight_bytes(self, bytes_per_param: int = 2) -> int:
        return self.params * bytes_per_param

    def kv_bytes_per_token(self, tp: int = 1, bytes_per_elem: int = 2) -> int:
        """KV bytes of one token summed over the `tp` GPUs: K and V, every layer, every stored KV
        head. With tp > kv_heads each GPU still needs one whole head, so heads are replicated
        (vLLM does this) and the group stores `tp` heads instead of `kv_heads`."""
        stored_heads = max(self.kv_heads, tp)
        return 2 * self.layers * stored_heads * self.head_dim * bytes_per_elem


# Hugging Face config.json of Qwen/Qwen2.5-{7B,32B,72B}(-Instruct); model cards: 7.61B, 32.5B
# (32.76B counted), 72.7B parameters; all three have untied input/output embeddings.
MODELS: dict[str, ModelShape] = {
    "7B": ModelShape("Qwen2.5-7B", layers=28, hidden=3584, heads=28, kv_heads=4, head_dim=128,
                     intermediate=18944, vocab=152064),
    "32B": ModelShape("Qwen2.5-32B", layers=64, hidden=5120, heads=40, kv_heads=8, head_dim=128,
                      intermediate=27648, vocab=152064),
    "72B": ModelShape("Qwen2.5-72B", layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128,
                      intermediate=29568, vocab=152064),
}


def gpu(name: str) -> GPU:
    try:
        return GPUS[name.upper().removesuffix("-SXM").removesuffix("-SXM5")]
    except KeyError:
        raise KeyError(f"unknown GPU {name!r}; known: {sorted(GPUS)}") from None


def model(name: str) -> ModelShape:
    """'72B', 'Qwen2.5-72B' or 'qwen2.5-72b-instruct' -> the 72B shape."""
    key = name.upper().removeprefix("QWEN2.5-").removesuffix("-INSTRUCT")
    try:
        return MODELS[key]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODELS)}") from None


def kv_capacity_tokens(m: ModelShape, g: GPU, tp: int, mem_fraction: float = 0.9, *,
                       bytes_per_param: int = 2, kv_bytes_per_elem: int = 2,
                       overhead_gib_per_gpu: float = 0.0) -> int:
    """Tokens of KV cache one inference replica (`tp` GPUs, bf16 weights and cache) can hold:

        (GPU memory × mem_fraction × tp − weight bytes − overhead × tp)
            ÷ (2 × layers × kv_heads × head_dim × bytes per element)

    (`kv_heads` becomes `tp` when tp > kv_heads: see `ModelShape.kv_bytes_per_token`.)

    Worked example, Qwen2.5-72B on 8×H800 at mem_fraction 0.9:
        memory   80 GiB × 0.9 × 8                      = 576 GiB = 618,475,290,624 B
        weights  72,706,203,648 params × 2 B            =           145,412,407,296 B
        free                                            =           473,062,883,328 B
        per token 2 × 80 layers × 8 heads × 128 × 2 B   = 327,680 B (320 KiB)
        capacity 473,062,883,328 ÷ 327,680              = 1,443,673 tokens
    i.e. about 1,400 sequences at the run's ~1K-token mean (prompt + response), more than the
    1,024 max concurrency per rollout; at 16K tokens each only ~88 fit.
    """
    if tp < 1 or not 0 < mem_fraction <= 1:
        raise ValueError(f"tp must be >= 1 and mem_fraction in (0, 1]; got tp={tp}, mem_fraction={mem_fraction}")
    usable = g.hbm_bytes * mem_fraction * tp - m.weight_bytes(bytes_per_param) - overhead_gib_per_gpu * GiB * tp
    if usable <= 0:
        raise ValueError(f"{m.name} ({m.weight_bytes(bytes_per_param) / GiB:.0f} GiB of weights) does not fit "
                         f"on {tp}×{g.name} at mem_fraction {mem_fraction}")
    return int(usable // m.kv_bytes_per_token(tp, kv_bytes_per_elem))
