"""The policy's parameters in one buffer, laid out as a published version lays them out.

A publish copies every tensor of the state dict to its offset in the staging (laminar/weights/
staging.py). Tensor by tensor, each copy is below the size at which glibc switches memcpy to
non-temporal stores, and on this project's machine that cost ~1.7x a single memcpy of the same
bytes. With the parameters stored end to end at their manifest offsets (alignment gaps included,
left zero), the sources of consecutive jobs continue each other in memory exactly as their places
do in the staging, and the copier does the whole model in one memcpy (a tied tensor named twice is
one more).

Only where it helps and is safe: one rank (FSDP2 shards parameters its own way), parameters on
the CPU (a GPU's copies are DMA at the link's speed, tensor by tensor), no LoRA (an adapter is
what is published). Each parameter keeps its identity (`param.data` becomes a view of the
buffer), so optimizers, checkpoints (`load_state_dict` copies in place) and autograd see no
difference; a later `param.data = ...` elsewhere only makes the copy tensor by tensor again.
"""
from __future__ import annotations

from laminar.weights.manifest import build_manifest


def flatten_parameters(model) -> int:
    """Move `model`'s parameters into one zeroed buffer at the offsets a publish of its state dict
    uses (with the tensors' own dtypes); returns the buffer's size in bytes (0: left as they
    were, e.g. a state dict with tensors that are not parameters, or mixed devices)."""
    import torch  # heavy: only a trainer that flattens its parameters loads it here
    sd = model.state_dict(keep_vars=True)
    params = {id(p) for p in model.parameters()}
    if not sd or any(id(t) not in params for t in sd.values()) or len({t.device for t in sd.values()}) != 1:
        return 0
    try:
        layout = build_manifest([(k, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in sd.items()], 0)
    except ValueError:  # a dtype no version carries: nothing to gain
        return 0
    flat = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=next(iter(sd.values())).device)
    done: set[int] = set()
    with torch.no_grad():
        for (_, p), off, n in zip(sd.items(), layout.offsets, layout.nbytes, strict=True):
            if id(p) in done:  # a tied parameter named twice: it lives at its first place
                continue
            done.add(id(p))
            view = flat[off:off + n].view(p.dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view
    return layout.total_bytes
