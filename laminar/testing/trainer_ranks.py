"""One rank of a multi-rank TrainEngine run, for tests: FSDP2 over gloo on CPU (NCCL on GPUs).

    python -m laminar.testing.trainer_ranks RANK WORLD ADDRESS MODEL_DIR OUT [--algorithm grpo|ppo]
        [--versions 2] [--device cpu] [--checkpoint DIR] [--publish same,bfloat16] [--variants JSON]

Every rank trains the same synthetic batches (random_groups, seeded) for `--versions` versions;
rank 0 writes OUT (torch.save): the full model state dict after training and each version's
metrics. A test compares that with one process training the same batches (`train_reference`).
--checkpoint: then every rank writes its shards of a sharded (DCP) checkpoint under DIR
(`resume_reference` resumes it in one process). --publish: then, per dtype, a sharded publish
(every rank copies its own shards), the same as if each rank were on a host of its own (mode
`hosts`: each rank's part publisher sends its byte ranges, the relay assembles them) and a publish
of the gathered state dict, each to a relay of its own in rank 0's process; OUT gets the three
versions' manifests and bytes (`publish_both`). --variants: a JSON list of trainer settings; then
each variant trains long-tailed batches (`long_tailed_batches`) with an engine of its own, one
after the other, and OUT gets {"variants": [{"model", "metrics"}, ...]} (micro-batch plans compared).
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import uuid

from laminar.roles.trainer import checkpoint, dist
from laminar.roles.trainer.config import TrainerConfig
from laminar.roles.trainer.engine import TrainEngine
from laminar.roles.trainer.sharded_publish import ShardedPublish, staging_prefix
from laminar.testing.load_ranks import rank_parser
from laminar.testing.settings import deep_merge
from laminar.testing.trainer_task import random_groups
from laminar.weights import wire
from laminar.weights.node import RelayNode
from laminar.weights.publisher import WeightPublisher
from laminar.weights.pull import LocalWeights
from laminar.weights.transport import get_transport

SETTINGS = {"optimizer": {"lr": 1e-3}, "ppo": {"critic_lr": 1e-3}, "minibatch_steps": 2,
            "performance": {"micro_batch_size": 3}}


def batches(versions: int) -> list:
    # 15 sequences: mini-batches of 8 and 7, shares of 4/4 and 4/3 -> one rank forwards an empty chunk
    return [random_groups(3, 5, f"v{v}", resp_len=6 + v, prompt_len=5, seed=v) for v in range(versions)]


def long_tailed_batches(versions: int) -> list:
    """Groups whose response lengths are long-tailed (lognormal, 2 to 60 tokens; seeded): dealt to
    ranks by count, the long ones land unevenly."""

    import numpy as np

    rng = np.random.default_rng(7)
    out = []
    for v in range(versions):
        groups = []
        for g in random_groups(4, 4, f"lt{v}", resp_len=60, prompt_len=5, seed=10 + v):
            lens = np.clip(np.exp(rng.normal(np.log(8), 0.9, len(g))), 2, 60).astype(int)
            groups.append([dataclasses.replace(t, response_tokens=t.response_tokens[:n], logprobs=t.logprobs[:n])
                           for t, n in zip(g, lens, strict=True)])
        out.append(groups)
    return out


def make_config(model_dir: str, algorithm: str, device: str, **overrides):
    """The ranks' TrainerConfig: SETTINGS with `overrides` (nested sections merge)."""
    return TrainerConfig(model_dir=model_dir, algorithm=algorithm, device=device, **deep_merge(SETTINGS, overrides))


def train_reference(model_dir: str, algorithm: str = "grpo", versions: int = 2, device: str = "cpu") -> dict:
    """The same run on one rank: {"model": state_dict, "metrics": [per version]}."""
    import torch

    torch.manual_seed(0)
    eng = TrainEngine(make_config(model_dir, algorithm, device), 0, torch.device(device))
    eng.load()
    metrics = [eng.train(b, v + 1) for v, b in enumerate(batches(versions))]
    return {"model": {k: v.detach().cpu().clone() for k, v in eng.full_state()["model"].items()}, "metrics": metrics}


def resume_reference(model_dir: str, checkpoint_dir: str, algorithm: str = "grpo", versions: int = 3,
                     device: str = "cpu") -> dict:
    """One process resumes the newest (sharded) checkpoint in `checkpoint_dir` and trains the
    batches after its version up to `versions`: {"model": state_dict, "metrics", "resumed": version}."""
    import torch

    torch.manual_seed(0)
    eng = TrainEngine(make_config(model_dir, algorithm, device), 0, torch.device(device))
    eng.load()
    path = checkpoint.latest(checkpoint_dir)
    state = checkpoint.read_state(path)
    eng.restore_sharded(path)
    start = int(state["version"])
    metrics = [eng.train(b, v + 1) for v, b in enumerate(batches(versions)) if v >= start]
    return {"model": {k: v.detach().cpu().clone() for k, v in eng.full_state()["model"].items()},
            "metrics": metrics, "resumed": start}


def publish_both(eng, info, dtypes: list[str]) -> dict | None:
    """Every rank: per dtype, a sharded publish, a sharded publish as if every rank were on a host
    of its own (`hosts`: parts assembled by the relay), and a publish of the gathered state dict,
    to three relays in rank 0's process; rank 0 returns {dtype: {"sharded"/"hosts"/"full":
    (manifest, bytes), "copied": [bytes each rank copied in the sharded publish]}}, None elsewhere."""

    key = wire.derive_key(b"k" * 32)
    nodes, pubs, out = [], [], {}
    sharded = full = hosts = None
    names = ("sharded", "full", "hosts")
    if info.is_main:
        for name in names:
            node = RelayNode(name, f"/dev/shm/laminar-ranks-{uuid.uuid4().hex[:10]}", get_transport("tcp"), key)
            node.start()
            nodes.append(node)
        sharded = WeightPublisher(chunk_bytes=64 << 10, key=key, staging_prefix=staging_prefix())
        full = WeightPublisher(chunk_bytes=64 << 10, key=key)
        hosts = WeightPublisher(chunk_bytes=64 << 10, key=key, staging_prefix=staging_prefix())
        pubs = [sharded, full, hosts]
        for pub, node in zip(pubs, nodes, strict=True):
            pub.set_target(node.address, node.id)
    sp = ShardedPublish(info, sharded)
    hp = ShardedPublish(info, hosts, one_rank_per_host=True,
                        make_publisher=lambda: WeightPublisher(chunk_bytes=64 << 10, key=key, part=True))
    try:
        for v, dtype in enumerate(dtypes, start=1):
            if info.is_main:
                for pub in pubs:
                    pub.publish_dtype = None if dtype == "same" else dtype
            sp.publish(eng.publish_state(), v)
            hp.publish(eng.publish_state(), v)
            copied = dist.all_reduce_sums(info, {f"r{r}": float(sp.last_copy_bytes if r == info.rank else 0)
                                                 for r in range(info.world_size)})
            gathered = eng.full_state()
            if not info.is_main:
                continue
            full.publish(gathered["model"], v)
            got = {"copied": [int(copied[f"r{r}"]) for r in range(info.world_size)]}
            for name, pub, node in zip(names, pubs, nodes, strict=True):
                assert pub.wait_delivered(v, 30), f"{name} v{v} not delivered"
                with node.store.cond:
                    node.store.cond.wait_for(lambda n=node, v=v: n.store.current is not None
                                             and n.store.current.version >= v, 30)
                with LocalWeights(node.store.dir).latest() as pulled:
                    assert pulled.version == v and pulled.verify() == [], name
                    got[name] = (pulled.manifest, bytes(pulled.buf[:pulled.manifest.total_bytes]))
            out[dtype] = got
    finally:
        sp.close()
        hp.close()
        for pub in pubs:
            pub.close()
        for node in nodes:
            node.stop()
            shutil.rmtree(node.store.dir, ignore_errors=True)
    return out if info.is_main else None


def main() -> None:
    import torch

    ap = rank_parser()
    ap.add_argument("--algorithm", default="grpo")
    ap.add_argument("--versions", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--checkpoint", default=None, help="write a sharded checkpoint here after training")
    ap.add_argument("--publish", default=None, help="comma-separated publish dtypes (same, bfloat16...)")
    ap.add_argument("--variants", default=None, help="JSON list of trainer settings, each trained on long-tailed "
                    "batches by an engine of its own")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = torch.device(a.device if a.device == "cpu" else f"cuda:{a.rank}")
    info = dist.init(a.rank, a.world, a.address, device, timeout_s=120)
    try:
        if a.variants:
            out = {"variants": []}
            for settings in json.loads(a.variants):
                torch.manual_seed(0)
                eng = TrainEngine(make_config(a.model_dir, a.algorithm, a.device, **settings), 0, device, info)
                eng.load()
                metrics = [eng.train(b, v + 1) for v, b in enumerate(long_tailed_batches(a.versions))]
                state = eng.full_state()
                if info.is_main:
                    out["variants"].append({"model": state["model"], "metrics": metrics})
            if info.is_main:
                torch.save(out, a.out)
            return
        eng = TrainEngine(make_config(a.model_dir, a.algorithm, a.device), 0, device, info)
        eng.load()
        metrics = [eng.train(b, v + 1) for v, b in enumerate(batches(a.versions))]
        state = eng.full_state()
        out = {"model": state["model"], "metrics": metrics} if info.is_main else None
        if a.checkpoint:
            path = eng.save_sharded(a.checkpoint, a.versions, {"cursor": 0}, keep=2)
            if info.is_main:
                out["checkpoint"] = str(path)
        if a.publish:
            published = publish_both(eng, info, a.publish.split(","))
            if info.is_main:
                out["published"] = published
        if info.is_main:
            torch.save(out, a.out)
    finally:
        dist.shutdown(info)


if __name__ == "__main__":
    main()
