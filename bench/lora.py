"""What a LoRA version costs the weight path next to a full one, on one model (SmolLM2 by default).

    python bench/lora.py [--model models/smollm2-math] [--rank 16] [--repeat 5] [--out F]

For the model's full weights and for a LoRA adapter of `--rank` on its attention and MLP
projections (what `roles.trainer.lora` publishes), measured in the same run:

- bytes per published version (the manifest's total_bytes: what every relay link carries);
- publish stall: the trainer's `WeightPublisher.publish` call (the copy into a staging slot; the
  relay chain is fed by the publisher's own thread afterwards), the median of `--repeat`;
- relay commit: writing a version into a relay's store, checksummed and sealed (what a relay does
  once a version's last chunk arrived; laminar/weights/local_write.py), the median;
- pull: a rollout's load from its host relay's folder: map the version and check its seals, then
  for full weights copy every tensor into a model of the same shape (what reload_weights does),
  for an adapter write its peft folder for vLLM (roles/rollout/adapters.py), the median.

Prints a table and, with --out, writes JSON with `bytes_full`, `bytes_lora`,
`publish_stall_full_s`, `publish_stall_lora_s`, `relay_commit_*_s`, `pull_*_s` and the ratios.
The network hop between relays is bytes / link rate: the bytes ratio is the ratio of that time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import exit_on_signals, print_table, write_json  # noqa: E402
from laminar.roles.rollout.adapters import Adapters  # noqa: E402
from laminar.roles.trainer.config import LoraSettings  # noqa: E402
from laminar.roles.trainer.lora import adapter_state, manifest_fields, with_adapter  # noqa: E402

from laminar.models.loading import load_causal_lm  # noqa: E402
from laminar.weights.local_write import write_version  # noqa: E402
from laminar.weights.publisher import WeightPublisher  # noqa: E402
from laminar.weights.pull import LocalWeights  # noqa: E402
from laminar.weights.store import ShmStore  # noqa: E402


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(name: str, state: dict, repeat: int, tmp: Path, fields: dict | None, load) -> dict:
    pub = WeightPublisher()
    version = iter(range(1, 10_000))
    try:
        pub.manifest_fields = fields or {}
        stall = timed(lambda: pub.publish(state, next(version)), repeat)
        total = pub.layout.total_bytes
    finally:
        pub.close()
    store = ShmStore(tmp / f"relay-{name}", retain=1)
    store.open()
    try:
        commit = timed(lambda: write_version(store, state, next(version), fields=fields), repeat)
        lw = LocalWeights(tmp / f"relay-{name}", verify_key=b"")

        def pull():
            with lw.latest() as pulled:
                load(pulled)
        pull_s = timed(pull, repeat)
        lw.close()
    finally:
        store.close()
    return {"bytes": total, "publish_stall_s": stall, "relay_commit_s": commit, "pull_s": pull_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/smollm2-math", help="a local Hugging Face causal-LM folder")
    ap.add_argument("--rank", type=int, default=16, help="the adapter's rank")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each measurement (the median is reported)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    exit_on_signals()
    torch.set_num_threads(1)
    model = load_causal_lm(args.model, "cpu", train=False)
    full = {k: v.detach() for k, v in model.state_dict().items()}
    target = load_causal_lm(args.model, "cpu", train=False)  # what a full version is loaded into
    peft_model = with_adapter(load_causal_lm(args.model, "cpu", train=False),
                              LoraSettings(rank=args.rank, alpha=2.0 * args.rank))
    lora = {k: v.detach() for k, v in adapter_state(peft_model.state_dict()).items()}
    fields = manifest_fields(peft_model, args.model)
    with tempfile.TemporaryDirectory(prefix="laminar-bench-lora-", dir="/dev/shm") as tmp:
        adapters = Adapters(args.model, str(Path(tmp) / "adapters"))

        def load_full(pulled):
            with torch.no_grad():
                for k, t in pulled.tensors():
                    target.state_dict()[k].copy_(t)

        def load_lora(pulled):
            adapters.load(pulled)
            adapters.unused()
        r_full = measure("full", full, args.repeat, Path(tmp), None, load_full)
        r_lora = measure("lora", lora, args.repeat, Path(tmp), fields, load_lora)
        adapters.close()
    rows = [[k, r_full[k], r_lora[k], r_full[k] / max(r_lora[k], 1e-12)]
            for k in ("bytes", "publish_stall_s", "relay_commit_s", "pull_s")]
    print_table(f"full weights vs a rank-{args.rank} LoRA adapter, {args.model} (medians of {args.repeat})",
                ["", "full", "lora", "full / lora"], rows)
    out = {"model": args.model, "rank": args.rank, "repeat": args.repeat,
           "params_full": sum(v.numel() for v in full.values()), "params_lora": sum(v.numel() for v in lora.values())}
    for k in ("bytes", "publish_stall_s", "relay_commit_s", "pull_s"):
        out[f"{k.removesuffix('_s')}_full{'_s' if k.endswith('_s') else ''}"] = r_full[k]
        out[f"{k.removesuffix('_s')}_lora{'_s' if k.endswith('_s') else ''}"] = r_lora[k]
        out[f"{k.removesuffix('_s')}_ratio"] = r_full[k] / max(r_lora[k], 1e-12)
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
