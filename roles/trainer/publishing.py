"""PublishLink: rank 0's connection to the relay tier (laminar.weights.WeightPublisher).

    link = PublishLink(role, settings); await link.start()   # target: the manager's master, or relay_address/relay_id
    link.publish_engine(engine, version)                # worker thread: returns after the staging copy
    await link.deliver_last(version)                    # the run's last version: wait until the master has it
    await link.close()

With several ranks (FSDP2) every rank has a PublishLink and calls publish_engine together (a
collective): ranks > 0 only copy their shards (`PublishLink.follower(role)`, no relay link),
rank 0's publisher owns the staging (shared /dev/shm slots) and the link to the master relay;
see sharded_publish.py. When the ranks span several hosts, the lowest rank of every other host
makes a part publisher of its own at the first publish (`_part_publisher`: its host's byte
ranges, to the master relay rank 0 names in each publish), and rank 0's becomes one too; the
master assembles each version from the hosts' parts. Rank 0's `deliver_last` then waits for its
own host's part. On one rank publish_engine publishes the model's own tensors.

`publish` costs one copy into a staging buffer; the relay chain is fed by the publisher's own
background thread, so training never waits for distribution. A watcher thread turns the
publisher's progress into `publish_delivered` events on the role's loop (in order with the
role's other events), which is how tests see that the next step started first.

Every version is sealed with the trainer's signing key (`weights.key_secret` of the key folder,
laminar/weights/seal.py), which relays and rollouts check: a cluster with keys needs it on the
trainer's hosts. A master relay that holds a newer lineage of this run refuses what rank 0
publishes: the trainer then fails, loudly, naming both lineages (it would otherwise train on
while nothing it publishes reaches a rollout), after recording that lineage beside its checkpoint
folder so that the restart takes a higher one (laminar/weights/publisher.py `note_lineage`).

Published dtype (`publish_dtype`): "rollout" (default) publishes floating-point weights in the
dtype the rollouts' engines run in (when they all agree; otherwise as the parameters are), so a
bf16 rollout fed by fp32 master weights receives half the bytes, cast on the trainer's device.
"""
from __future__ import annotations

import asyncio
import re
import threading

from laminar.bus.retry import Backoff
from laminar.roles.trainer.sharded_publish import ShardedPublish, staging_prefix

from laminar.weights.lineage import note_lineage
from laminar.weights.publisher import WeightPublisher
from laminar.weights.seal import signer_of
from laminar.weights.transport import get_transport
from laminar.weights.wire import derive_key

RETRY_S = (0.5, 10.0)    # a pinned master relay's reconnect delay: first, and at most
FINAL_DELIVERY_S = 60.0  # how long a finished trainer waits for its last version to reach the master relay


class PublishLink:
    def __init__(self, role, settings):
        self.role, self.settings = role, settings
        self.publisher = None
        self.follower = None
        self.sharded = None  # ShardedPublish when the trainer has several ranks
        self.last_stall_s = 0.0
        self._described = False  # publisher.manifest_fields set from the engine
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._refusal: asyncio.Future | None = None  # set (with the reason) when the master refuses a version

    def _relay_address(self) -> str | None:
        c, cluster = self.settings, self.role.cluster
        if c.publishing.relay_address:
            return c.publishing.relay_address
        if c.publishing.relay_id is not None:
            host, _ = cluster.spec("relay", c.publishing.relay_id)
            port = cluster.relay_settings(c.publishing.relay_id).data_port
            if port:
                return f"{cluster.cluster.hosts[host].address}:{port}"
        return None

    def _pin(self, address: str, relay_id: str) -> None:
        """A pinned master (no manager to name another): a failed link (the relay not up yet, or
        restarting) is tried again at the same address, 0.5 s after the failure doubling to 10 s,
        back to 0.5 s once a version got through. Without it the publisher waited for a
        set_target that nothing would send."""
        loop = asyncio.get_running_loop()
        pub, wait, state = self.publisher, Backoff(*RETRY_S), {"delivered": -1}

        def retry() -> None:
            if not self._stop.is_set():
                pub.set_target(address, relay_id)

        def down(peer: str) -> None:  # the publisher's link thread
            if self._stop.is_set():
                return
            if pub.delivered > state["delivered"]:
                state["delivered"] = pub.delivered
                wait.reset()
            loop.call_soon_threadsafe(loop.call_later, wait.next(), retry)
        pub.on_link_down = down
        pub.set_target(address, relay_id)

    def publish_dtype(self) -> str | None:
        """The dtype published weights are cast to (None: the parameters' own)."""
        want = self.settings.publishing.dtype
        if want != "rollout":
            return None if want in (None, "same") else want
        return rollout_dtype(self.role.cluster)

    async def start(self) -> None:

        c, ctx = self.settings, self.role.ctx
        keys = getattr(ctx.transport, "keys", None)
        info = getattr(self.role, "info", None)
        multi = info is not None and info.enabled
        transport = get_transport(c.publishing.transport, **c.publishing.transport_options)
        loop = asyncio.get_running_loop()
        self._refusal = loop.create_future()
        self.publisher = WeightPublisher(c.publishing.chunk_mb << 20, transport,
                                         derive_key(keys.secret if keys else None),
                                         publish_dtype=self.publish_dtype(),
                                         staging_prefix=staging_prefix() if multi else None, signer=signer_of(keys),
                                         on_refused=lambda why: loop.call_soon_threadsafe(self._refused, why))
        self.role.spawn(self._fail_on_refusal(), "lineage-guard")
        if multi:
            self.sharded = ShardedPublish(info, self.publisher)
        # With a manager in the cluster, the master is whoever heads its chain (it changes when a
        # master dies): follow it. relay_id/relay_address pin a target only in a cluster without one.
        has_manager = bool(self.role.cluster.find("manager"))
        address = c.publishing.relay_address or (None if has_manager else self._relay_address())
        if address:
            self._pin(address, c.publishing.relay_id or "")
        elif has_manager:
            # late: only with a manager (the follower of its relay chain)
            from laminar.weights.follow import MasterFollower
            self.follower = MasterFollower(self.publisher, ctx.transport,
                                           self.role.cluster.endpoint("manager", c.publishing.manager_id))
            await self.follower.start()
            self.role.spawn(self.follower.watch(), "master-follower")  # a failed follow loop fails the trainer
        else:
            raise ValueError("trainer.publishing.enabled is on but there is no publishing.relay_address, "
                             "publishing.relay_id with a data_port, or manager to name the master relay")
        self._watcher = threading.Thread(target=self._watch, args=(loop,), name="trainer-delivery", daemon=True)
        self._watcher.start()

    def _refused(self, why: str) -> None:
        """The master refused a version (it holds a newer lineage of this run): record the newer
        lineage beside the checkpoint folder, so a restart starts above it, and fail the trainer."""

        found = re.search(r"holds lineage (\d+)", why)
        folder = getattr(self.role, "ckpt_root", None)
        if found and folder is not None:
            note_lineage(folder, self.publisher.run_id, int(found.group(1)))
        if self._refusal is not None and not self._refusal.done():
            self._refusal.set_result(why)

    async def _fail_on_refusal(self) -> None:
        why = await self._refusal
        self.role.event("weights_lineage_refused", why=why)
        raise RuntimeError(f"the master relay refused this trainer's weights: {why}. This trainer's lineage is older "
                           "than one the relays hold (a checkpoint folder restored from an older copy, or a second "
                           "trainer of the same run); it restarts on a lineage above it")

    @classmethod
    def follower(cls, role) -> PublishLink:
        """A rank > 0's link: it copies its shards into rank 0's staging, nothing else."""
        link = cls(role, role.settings)
        link.sharded = ShardedPublish(role.info, make_publisher=link._part_publisher)
        return link

    def _part_publisher(self):
        """A host leader's publisher when the ranks span hosts: its host's part of each version
        (staging shared with the host's other ranks), sent to the master relay rank 0 names;
        ShardedPublish owns and closes it."""

        c = self.settings
        keys = getattr(self.role.ctx.transport, "keys", None)
        p = c.publishing
        return WeightPublisher(p.chunk_mb << 20, get_transport(p.transport, **p.transport_options),
                               derive_key(keys.secret if keys else None), publish_dtype=self.publish_dtype(),
                               staging_prefix=staging_prefix(), part=True, reconnect_s=1.0, signer=signer_of(keys))

    def publish(self, state_dict, version: int) -> None:
        self.publisher.publish(state_dict, version)

    def publish_engine(self, engine, version: int) -> None:
        """Publish the engine's weights as `version`: on several ranks a sharded publish, which
        every rank calls together (nothing gathered); on one rank the model's own tensors, by
        default overlapped: only the GPU copies are queued here, the engine's next optimizer step
        waits for them on the GPU, and the version is committed when they land (publisher.py)."""
        if not self._described:  # once: a LoRA adapter's content, config and base identity
            if self.publisher is not None:  # ranks > 0 of a sharded publish have no publisher of their own
                self.publisher.manifest_fields = engine.manifest_fields()
            self._described = True
        if self.sharded is not None:
            self.sharded.publish(engine.publish_state(), version)
        elif self.settings.publishing.overlap:  # GPU copies run on while the next forward/backward does
            engine.before_update = self.publisher.publish_async(engine.full_state()["model"], version).guard
        else:
            self.publisher.publish(engine.full_state()["model"], version)

    def _watch(self, loop) -> None:
        pub, last = self.publisher, -1
        while not self._stop.is_set():
            with pub.cond:
                pub.cond.wait_for(lambda last=last: pub.delivered > last or pub.stopped or self._stop.is_set(), 0.5)
                d, stopped = pub.delivered, pub.stopped
            if stopped:
                return
            if d > last:
                last = d
                loop.call_soon_threadsafe(lambda v=d: self.role.event("publish_delivered", version=v))

    async def deliver_last(self, version: int, timeout_s: float = FINAL_DELIVERY_S) -> bool | None:
        """Wait until the master relay holds `version` (the run's last), at most `timeout_s`: the
        sender runs in the background, and closing right after the last step would drop it, so
        rollouts and the evaluator would never get the final weights. None without a publisher."""
        if self.publisher is None:
            return None
        await asyncio.to_thread(self.publisher.wait_pending, timeout_s)  # an overlapped last copy: its error
        return await asyncio.to_thread(self.publisher.wait_delivered, version, timeout_s)  # close() ends it

    async def close(self) -> None:
        self._stop.set()
        if self.sharded is not None:  # a host leader first waits for its part of the last version
            await asyncio.to_thread(self.sharded.close)
        if self.follower is not None:
            await self.follower.close()
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.close)


def rollout_dtype(config) -> str | None:
    """The engine dtype every rollout of the cluster config runs in, or None (no rollout, or they
    differ: the weights are then published as they are)."""
    names = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}
    found = {str(config.role_settings("rollout", spec.id).get("dtype", "float32"))
             for _, spec in config.find("rollout")}
    return names.get(found.pop()) if len(found) == 1 else None  # "auto" and the like: as they are
