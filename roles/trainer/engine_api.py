"""What the trainer role calls on its training engine, as a typed protocol.

Two engines implement `TrainEngineAPI`: `TrainEngine` (roles/trainer/engine.py: torch, FSDP2,
GRPO/PPO) and `SimTrainEngine` (roles/trainer/sim_engine.py: the scale simulator's trainer, which
spends the cost model's time instead; docs/sim.md). The protocol is structural (`typing.Protocol`,
runtime-checkable): tests/unit/roles/test_engine_api.py checks that both define every method with the
protocol's signature and the attributes the role reads.

    engine.load()                                   # build the model (the sim: nothing)
    engine.restore(parts)                           # from a checkpoint's state dicts
    metrics = engine.train(groups, version)         # one iteration on whole GRPO groups
    state = engine.full_state(with_optimizer=True)  # {part: state_dict} on rank 0, for publish/checkpoint
    engine.params                                   # parameter count (after load)

With several ranks (world_size > 1, only the torch engine: the sim engine refuses it) the role
also calls `ShardedTrainEngineAPI`'s collectives, which move shards and never gather:

    state = engine.publish_state()                  # this rank's tensors (DTensor shards), for a sharded publish
    path = engine.save_sharded(root, version, state, keep)   # every rank writes its shards (DCP)
    engine.restore_sharded(path)                    # every rank reads its shards, any rank count

The real engine is built by the role's `_load` (seeds, device, the distributed group, resume
from a checkpoint); the sim engine by `SimTrainEngine.from_trainer_config` (settings, the modeled
weight delivery), which sets nothing on the role.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class TrainEngineAPI(Protocol):
    """A training engine as the trainer role drives it (from a worker thread: every method may
    block for an iteration's time)."""

    params: int

    def load(self) -> None:
        """Build the model and optimizer (on every rank)."""
        ...

    def restore(self, parts: dict | None) -> None:
        """Take a checkpoint's state dicts ({part: state_dict}; None on ranks other than 0)."""
        ...

    def train(self, groups: Any, version: int) -> dict:
        """One iteration on `groups` (lists of trajectories, one list a GRPO group), producing
        weights `version`; the iteration's metrics (float values)."""
        ...

    def full_state(self, with_optimizer: bool = False) -> dict | None:
        """The full (unsharded) state dicts {part: state_dict}, on rank 0 (None elsewhere): the
        weights to publish, or with the optimizer's state a checkpoint's."""
        ...


@runtime_checkable
class ShardedTrainEngineAPI(TrainEngineAPI, Protocol):
    """A training engine with several ranks: the collectives the role calls on every rank
    together (roles/trainer/sharded_publish.py, checkpoint.save_sharded / load_sharded)."""

    def publish_state(self) -> dict:
        """This rank's model state dict as it holds it (its own tensors; DTensor shards under
        FSDP2): no gather, no copy."""
        ...

    def save_sharded(self, root, version: int, state: dict, keep: int):
        """Every rank writes its own shards of a checkpoint of `version` under rank 0's `root`
        (with the role's `state`, keeping `keep` checkpoints); the path on rank 0, None elsewhere."""
        ...

    def restore_sharded(self, path) -> None:
        """Every rank loads its shards of the sharded checkpoint at `path`, whatever number of
        ranks wrote it."""
        ...
