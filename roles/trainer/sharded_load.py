"""Sharded load: every rank materialises only its own FSDP2 shard, read straight from the safetensors files.

    model = build_on_meta(model_dir, dtype="float32")      # no storage at all: shapes only
    ... prepare (attention kernels, checkpointing), wrap (LoRA), shard (dist.shard: FSDP2 units) ...
    report = materialize(model, model_dir, device, seed)   # each rank reads its rows, nothing more

The old way loaded the whole model on every rank (Hugging Face's `from_pretrained`, float32) and
sharded it afterwards: a 72B model needs 271 GiB on each rank before its first step. Here the
model is built on the meta device (no memory), FSDP2 shards it there (every parameter becomes a
DTensor whose local piece is a range of rows, dim 0), `to_empty` allocates just the local pieces
on the rank's device, and each piece is filled from the safetensors files: `safe_open(...)
.get_slice(name)[start:stop]` reads those rows through the file's memory mapping (rows are
contiguous in the file, so only their pages are touched), casts them to the parameter's dtype
(float32 master weights, or the LoRA base in the serving dtype) and copies them into place. No
rank ever holds more than its shard plus one tensor's slice in flight. One rank (no FSDP2) reads
every tensor whole, the same code.

What a meta build does not give and is put back here:
- buffers (the rotary embedding's inverse frequencies, computed in the module's constructor): a
  parameterless module that owns buffers is built again from the model's config on the CPU and its
  tensors moved to the device (a module that cannot be rebuilt so is an error naming it);
- tied embeddings: the output head and the input embedding are one Parameter (one FSDP2 unit, see
  dist.shard) and are read once, from whichever name the files hold;
- a LoRA adapter (peft) built on the meta base: A is drawn as peft draws it (Kaiming uniform,
  a = sqrt(5)) from a generator seeded alike on every rank, B is zero, each rank keeping its rows.

A name the model has and the files lack is an error naming it; a tensor in the files the model does
not use is counted in the report (`unused`), never silently loaded somewhere else.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from laminar.roles.trainer.dist import shard
from laminar.roles.trainer.lora import with_adapter
from laminar.roles.trainer.memory import PeakMemory

from laminar.models.loading import load_causal_lm, read_config, torch_dtype

log = structlog.get_logger("laminar.trainer.sharded_load")

PEFT_PREFIX = "base_model.model."   # peft's wrapper in front of the base model's own names


@dataclass
class LoadReport:
    """What one rank's load took: seconds, bytes it read and holds, its peak memory above the start."""
    model_dir: str
    seconds: float = 0.0
    bytes_read: int = 0
    local_bytes: int = 0
    peak_bytes: int = 0
    peak_kind: str = ""
    tensors: int = 0
    unused: list[str] = field(default_factory=list)

    def fields(self) -> dict:
        return {"load_s": round(self.seconds, 3), "bytes_read": self.bytes_read, "local_bytes": self.local_bytes,
                "peak_bytes": self.peak_bytes, "peak_kind": self.peak_kind, "tensors": self.tensors,
                "unused_tensors": len(self.unused)}


def safetensors_index(model_dir) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (model.safetensors, or the shards an index names)."""
    from safetensors import safe_open  # late: safetensors, only when a model is loaded
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: d / f for name, f in weight_map.items()}
    out: dict[str, Path] = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: f for k in h.keys()})  # noqa: SIM118 (safe_open is no dict)
    return out


def has_safetensors(model_dir) -> bool:
    d = Path(model_dir)
    return (d / "model.safetensors.index.json").is_file() or any(d.glob("*.safetensors"))


def build_on_meta(model_dir, dtype: str = "float32"):
    """The model of `model_dir`'s config.json on the meta device, in `dtype`: shapes, no storage."""
    import torch  # late: torch; configs validate without it
    import transformers
    read_config(model_dir)
    config = transformers.AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))


def base_of(model):
    """The Hugging Face model under a peft wrapper (the model itself without one)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def file_key(name: str) -> str:
    """A parameter's name in the files: without peft's prefix and its `base_layer` step."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX):]
    return name.replace(".base_layer.", ".")


def local_rows(param) -> tuple[int, int]:
    """(first row, rows) of this rank's piece of `param` along dim 0 (the whole tensor when not a DTensor)."""
    if not hasattr(param, "device_mesh"):
        return 0, (param.shape[0] if param.dim() else 1)
    from torch.distributed.tensor import Shard  # late: torch; configs validate without it
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    for pl in param.placements:
        if isinstance(pl, Shard) and pl.dim != 0:
            raise ValueError(f"sharded load reads row ranges: a parameter sharded on dim {pl.dim} is not supported")
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return (offset[0], shape[0]) if param.dim() else (0, 1)


def local_tensor(param):
    return param.to_local() if hasattr(param, "to_local") else param


def materialize(model, model_dir, device, seed: int = 0, zeros: tuple[str, ...] = ()) -> LoadReport:
    """Allocate this rank's pieces of the (sharded, meta) `model` on `device` and fill them from the
    safetensors files of `model_dir`; buffers rebuilt, a LoRA adapter initialized, parameters whose
    names start with one of `zeros` (a critic's value head: not in the files) zero. Every rank calls
    it (no collective inside). Returns what the load took."""
    import torch  # late: torch; configs validate without it
    report = LoadReport(str(model_dir))
    with PeakMemory(device) as peak:
        t0 = time.perf_counter()
        buffers = _rebuild_buffers_later(model)
        shared = _shared_parameters(model)
        model.to_empty(device=device)
        _retie(shared)
        _restore_buffers(buffers, device)
        index = safetensors_index(model_dir)
        wanted = set()
        adapter = []
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_A." in name or ".lora_B." in name:
                    adapter.append((name, param))
                    continue
                if name.startswith(zeros):
                    local_tensor(param).zero_()
                    continue
                key = _resolve(file_key(name), index, model)
                wanted.add(key)
                report.bytes_read += _fill(param, index[key], key)
                report.tensors += 1
            _init_adapter(adapter, seed)
        report.unused = sorted(k for k in index if k not in wanted and not _tied_alias(k, model))
        report.local_bytes = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
        report.seconds = time.perf_counter() - t0
    report.peak_bytes, report.peak_kind = peak.peak_bytes, peak.kind
    return report


def _resolve(key: str, index: dict, model) -> str:
    """The file's name for parameter `key`: itself, or for a tied head the input embedding's."""
    if key in index:
        return key
    tied = _tied_source(key, model)
    if tied is not None and tied in index:
        return tied
    raise KeyError(f"sharded load: the model's parameter {key} is in none of the safetensors files")


def _tied_source(key: str, model) -> str | None:
    """For a tied model, the other name of `key` (Hugging Face's `_tied_weights_keys` map)."""
    base = base_of(model)
    if not getattr(getattr(base, "config", None), "tie_word_embeddings", False):
        return None
    tied = getattr(base, "_tied_weights_keys", None) or {}
    if isinstance(tied, dict):
        pairs = dict(tied)
        pairs.update({v: k for k, v in tied.items()})
        return pairs.get(key)
    return None


def _tied_alias(key: str, model) -> bool:
    """A name in the files that a tied parameter shares (read once under its other name)."""
    return _tied_source(key, model) is not None


def _fill(param, path: Path, key: str) -> int:
    """Copy this rank's rows of tensor `key` (file `path`) into `param`'s local piece; bytes read. The
    file is mapped for this tensor alone (opening one costs a header parse, a fraction of a
    millisecond): the pages read through a mapping count in the process's memory until it is
    unmapped, so a mapping kept over the whole load would hold the rank's share of the file too."""
    from safetensors import safe_open  # late: safetensors, only when a model is loaded
    local = local_tensor(param)
    start, rows = local_rows(param)
    with safe_open(str(path), framework="pt") as f:
        sl = f.get_slice(key)
        shape = tuple(sl.get_shape())
        if shape != tuple(param.shape):
            raise ValueError(f"sharded load: {key} is {list(shape)} in {path.name}, the model wants "
                             f"{list(param.shape)}")
        if rows == 0:
            return 0
        piece = sl[start:start + rows] if len(shape) else f.get_tensor(key)
    local.copy_(piece.to(device=local.device, dtype=local.dtype).view(local.shape))
    return piece.numel() * piece.element_size()


def _shared_parameters(model) -> list[list[tuple]]:
    """Parameters registered in several modules (tied embeddings): [[(module, name), ...], ...]."""
    seen: dict[int, list[tuple]] = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                seen.setdefault(id(p), []).append((m, name))
    return [places for places in seen.values() if len(places) > 1]


def _retie(shared: list[list[tuple]]) -> None:
    """`to_empty` gives each module a Parameter of its own unless FSDP2 swapped them in place: the
    tied places share the first one's again."""
    for places in shared:
        first = places[0][0]._parameters[places[0][1]]
        for m, name in places[1:]:
            m._parameters[name] = first


def _rebuild_buffers_later(model) -> list:
    """Modules that own buffers but no parameters (rotary embeddings): [(module, fresh CPU copy)],
    the copy built from the model's config now (a meta build computed nothing)."""
    import torch  # late: torch; configs validate without it
    out = []
    config = getattr(base_of(model), "config", None) or model.model.config  # a critic: its body's
    for name, m in model.named_modules():
        if not list(m.buffers(recurse=False)):
            continue
        if list(m.parameters(recurse=False)):
            raise ValueError(f"sharded load: module {name} holds buffers and parameters; its buffers cannot be "
                             f"rebuilt from the config")
        try:
            with torch.device("cpu"):
                fresh = type(m)(config=config)
        except TypeError as exc:
            raise ValueError(f"sharded load: cannot rebuild the buffers of {name} ({type(m).__name__}) from the "
                             f"model's config: {exc}") from None
        out.append((m, fresh))
    return out


def _restore_buffers(rebuilt: list, device) -> None:
    import torch  # late: torch; configs validate without it
    for m, fresh in rebuilt:
        for bname, b in fresh.named_buffers(recurse=False):
            m._buffers[bname] = b.to(device)
        for attr, v in vars(fresh).items():  # tensors kept as plain attributes (original_inv_freq)
            if isinstance(v, torch.Tensor) and attr not in ("_buffers", "_parameters"):
                setattr(m, attr, v.to(device))


def _init_adapter(adapter: list, seed: int) -> None:
    """peft's default LoRA init, alike on every rank: A Kaiming-uniform (a = sqrt(5)) from a generator
    seeded by `seed`, drawn whole in name order; B zeros. Each rank keeps its rows."""
    import torch  # late: torch; configs validate without it
    if not adapter:
        return
    gen = torch.Generator().manual_seed(seed * 7_919 + 17)
    for name, param in sorted(adapter, key=lambda x: x[0]):
        full = torch.zeros(tuple(param.shape), dtype=torch.float32)
        if ".lora_A." in name:
            bound = 1.0 / math.sqrt(full.shape[1]) if full.dim() > 1 else 0.0  # kaiming_uniform, a = sqrt(5)
            full.uniform_(-bound, bound, generator=gen)
        start, rows = local_rows(param)
        local = local_tensor(param)
        local.copy_(full[start:start + rows].to(device=local.device, dtype=local.dtype))



def load_model(model_dir, device, info, *, dtype: str = "float32", train: bool = True, frozen: bool = False,
               prepare=None, lora=None, param_dtype=None, seed: int = 0, sharded: bool = True):
    """(model, LoadReport): a trainer's model, sharded over `info`'s ranks (dist.shard). `prepare(model)`
    runs before sharding (attention kernels, checkpointing, context parallelism); `lora`: the model
    is the frozen base in `dtype` with a fresh adapter. `sharded` and safetensors files: built on the
    meta device and each rank reads its own rows (module docstring); else the whole model is loaded
    on every rank and sharded afterwards (the old way: `.bin` folders, or `sharded_load: false`)."""
    steps = dict(info=info, device=device, train=train, frozen=frozen, prepare=prepare, lora=lora,
                 param_dtype=param_dtype)
    why = "full load"
    if sharded and has_safetensors(model_dir):
        meta = build_on_meta(model_dir, dtype)
        missing = missing_in_files(meta, model_dir)
        if missing is None:
            model = _assemble(meta, **steps)
            return model, materialize(model, model_dir, device, seed)
        # the files name tensors otherwise than the model (a mixture of experts' fused expert tensors,
        # which transformers converts as it loads): the old way, said in the report and the log
        why = f"full load: the files lack {missing} by that name"
        log.warning("sharded_load_unavailable", model_dir=str(model_dir), missing=missing)
    with PeakMemory(device) as peak:
        t0 = time.perf_counter()
        model = _assemble(load_causal_lm(model_dir, device, dtype=dtype, train=train), **steps)
        seconds = time.perf_counter() - t0
    local = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
    return model, LoadReport(str(model_dir), seconds=seconds, local_bytes=local, peak_bytes=peak.peak_bytes,
                             peak_kind=f"{peak.kind}, {why}")


def missing_in_files(model, model_dir) -> str | None:
    """The first parameter of `model` (built on the meta device) that the safetensors files do not
    hold under its name (or, for a tied head, the embedding's); None when they hold every one."""
    index = safetensors_index(model_dir)
    for name, _ in model.named_parameters():
        try:
            _resolve(file_key(name), index, model)
        except KeyError:
            return file_key(name)
    return None


def load_critic_model(model_dir, device, info, *, prepare=None, param_dtype=None, sharded: bool = True):
    """(critic, LoadReport): PPO's critic (laminar.algorithms.ppo.load_critic: the policy's body and a
    zero value head), sharded; its body read rank by rank from the files as `load_model` reads a policy
    (the files' names are the critic's: its body is its `model`), the value head zero."""
    import torch  # late: torch; configs validate without it
    import transformers

    from laminar.algorithms.ppo import load_critic
    if sharded and has_safetensors(model_dir) and missing_in_files(build_on_meta(model_dir), model_dir) is not None:
        sharded = False  # the files name tensors otherwise than the model (load_model says which)
    if not (sharded and has_safetensors(model_dir)):
        with PeakMemory(device) as peak:
            t0 = time.perf_counter()
            critic = load_critic(model_dir, device)
            _prepare_and_shard(critic, info, device, prepare, param_dtype)
            seconds = time.perf_counter() - t0
        return critic, LoadReport(str(model_dir), seconds=seconds, peak_bytes=peak.peak_bytes,
                                  peak_kind=f"{peak.kind}, full load")
    config = transformers.AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    with torch.device("meta"):
        body = transformers.AutoModel.from_config(config, dtype=torch.float32)
    critic = load_critic(model_dir, device, body=body)
    _prepare_and_shard(critic, info, device, prepare, param_dtype)
    return critic, materialize(critic, model_dir, device, zeros=("value_head.",))


def _prepare_and_shard(critic, info, device, prepare, param_dtype) -> None:
    if prepare is not None:
        prepare(critic.model)
    shard(critic, info, device, param_dtype=param_dtype)


def _assemble(model, *, info, device, train: bool, frozen: bool, prepare, lora, param_dtype):
    """Wrap in a LoRA adapter, freeze (a frozen copy: adapter too), set the mode, prepare and shard."""
    if lora is not None:
        model = with_adapter(model, lora)  # freezes the base; the adapter trains
    if frozen:
        model.requires_grad_(False)
    model.train(train)
    if prepare is not None:
        prepare(model)
    shard(model, info, device, param_dtype=param_dtype)
    return model
