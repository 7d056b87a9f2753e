"""vLLM worker extension: methods that run *inside* each of the engine's worker processes.

vLLM's async engine runs the model in other processes, one per tensor-parallel rank, and tensors
passed through `collective_rpc` arrive as lists there (`'list' object has no attribute 'dtype'`).
So every worker reads the weights itself: from its host relay's shared memory (read-only views of
the relay's memory-mapped slot file, laminar/weights/pull.py) or from a file, and feeds them to
`model_runner.reload_weights`, where the model's `load_weights` slices each full tensor to the
rank's shard. No rank copies the whole model: the views are page-cache memory all ranks share.

One version for all ranks. A load is three collective calls, driven by the engine
(roles/rollout/engine.py):

    laminar_prepare(source)  every rank takes hold of the version (shared lock, mapping, seals);
                             nothing is loaded yet. Any rank failing: every rank lets go.
    laminar_commit()         every rank loads its shard of the held version.
    laminar_settle(ok)       ok: the new version becomes what each rank runs; not ok (a rank
                             failed its commit): every rank that touched its weights reloads the
                             ones it had, from where they came (the model folder, the relay's
                             version, current or retained, or the file), so no rank is left on a
                             mix of versions.

Every method answers (ok, value) and never raises: vLLM's executor stops reading the ranks'
replies at the first failed one, and the unread replies of the others would be taken as the
answers to the next call.

One `LocalWeights` per relay folder lives as long as the worker: its slot mappings are cached
(no page-table set-up per version) and, on a GPU, each slot file's mapping is page-locked with
CUDA once (`LocalWeights.pin`), so every later version in the same file reaches the GPU at pinned
speed inside reload_weights. Without CUDA (the CPU build) pin() does nothing.

Mixture-of-experts models (roles/rollout/moe_worker.py): `laminar_routing_start` binds the routing
capture to every MoE layer's router (the CPU build's way to record the experts the engine chose),
`laminar_routing_take` answers the rows of the requests asked for; after every in-place load the CPU
expert kernels' prepack runs again (a vLLM 0.32 CPU-build bug: `repack_cpu_experts`). These
answer (ok, value) and never raise, like the load phases.

Test hook (tests only, never set in a deployment): when LAMINAR_TEST_FAIL_LOAD names a file, each
prepare and commit reads it; a line "RANK PHASE" (PHASE: prepare or commit) makes that rank fail
that phase, a commit after loading half of the tensors, as a rank that runs out of memory
part-way would. tests/integration/rollout/test_tensor_parallel.py injects failures this way.
"""
from __future__ import annotations

import os

from laminar.roles.rollout.moe_worker import repack_cpu_experts

from laminar.weights.manifest import ident
from laminar.weights.pull import LocalWeights

FAULT_ENV = "LAMINAR_TEST_FAIL_LOAD"


class LaminarWorkerExtension:
    """Weight loading for one engine worker (one tensor-parallel rank)."""

    def _laminar_weights(self, shm_dir: str):
        """The worker's LocalWeights of one relay folder (made on first use, then kept)."""
        held = self.__dict__.setdefault("_laminar_local_weights", {})
        weights = held.get(shm_dir)
        if weights is None:
            weights = held[shm_dir] = LocalWeights(shm_dir)
        return weights

    def _laminar_state(self) -> dict:
        """This worker's load state: `runs` (where the weights it runs came from: ("model",),
        ("relay", dir, (run_id, lineage, version)) or ("file", path)), `held` (the prepared
        version), `next` (its source), `touched` (a commit began since the last settle)."""
        return self.__dict__.setdefault("_laminar", {"runs": ("model",), "held": None, "next": None,
                                                     "touched": False})

    def laminar_rank(self) -> int:
        # late: vLLM, loaded only in an engine process
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())

    # -- the three phases --------------------------------------------------------------------
    def laminar_prepare(self, source: tuple) -> tuple[bool, int | str]:
        """Take hold of what `source` names: ("relay", shm_dir, min_version, exact) -> the version
        (-1: none newer than min_version / exact not there; `exact` names the weights, (run_id,
        lineage, version), and the version held is checked against it: a number another lineage
        reused is not there); ("file", path) -> 0."""
        st = self._laminar_state()
        try:
            self._laminar_release()
            if source[0] == "relay":
                _, shm_dir, min_version, exact = source
                w = self._laminar_weights(shm_dir)
                pulled = w.latest(min_version) if exact is None else w.version(exact)
                if pulled is None:
                    return True, -1
                # named in full: a restore must find these weights, not the number's next owner
                st["held"], st["next"] = pulled, ("relay", shm_dir, ident(pulled.manifest))
                version = pulled.version
            elif source[0] == "file":
                st["held"], st["next"] = _read_file(source[1]), ("file", source[1])
                version = 0
            else:
                raise ValueError(f"unknown weight source {source[0]!r}")
            self._laminar_fault("prepare")
            return True, version
        except Exception as exc:  # noqa: BLE001 - answered, never raised (see the module docstring)
            self._laminar_release()
            return False, _describe(exc)

    def laminar_commit(self) -> tuple[bool, str]:
        """Load the held version into this rank's shard of the model."""
        st = self._laminar_state()
        if st["held"] is None:
            return False, "nothing prepared"
        st["touched"] = True
        try:
            weights = self._laminar_weights(st["next"][1]) if st["next"][0] == "relay" else None
            self._laminar_reload(st["held"], weights, commit=True)
            return True, ""
        except Exception as exc:  # noqa: BLE001 - answered, never raised (see the module docstring)
            return False, _describe(exc)

    def laminar_settle(self, ok: bool) -> tuple[bool, str]:
        """ok: the committed version is what this rank runs. Not ok: if this rank's weights were
        touched, reload the ones it ran (False and why, when they cannot be had any more)."""
        st = self._laminar_state()
        try:
            if ok:
                st["runs"] = st["next"]
                return True, ""
            if st["touched"]:
                self._laminar_restore(st["runs"])
            return True, ""
        except Exception as exc:  # noqa: BLE001 - answered, never raised (see the module docstring)
            return False, _describe(exc)
        finally:
            self._laminar_release()

    # -- mixture of experts (moe_worker.py) ----------------------------------------------------
    def laminar_routing_start(self) -> tuple[bool, dict | str]:
        """Start capturing the routing of every step: (True, {layers, top_k, experts, dtype})."""
        from laminar.roles.rollout.moe_worker import RoutingCapture  # late: only for a MoE policy's routing
        try:
            if "_laminar_routing" not in self.__dict__:
                capture = RoutingCapture(self.model_runner)
                info = capture.install()
                self._laminar_routing = capture
                self._laminar_routing_info = info
            return True, self._laminar_routing_info
        except Exception as exc:  # noqa: BLE001 - answered, never raised (see the module docstring)
            return False, _describe(exc)

    def laminar_routing_take(self, asks: list, drop: list) -> tuple[bool, list | str]:
        """The rows held of (request id, start, end) each (RoutingCapture.take)."""
        try:
            return True, self.__dict__["_laminar_routing"].take(asks, drop)
        except Exception as exc:  # noqa: BLE001 - answered, never raised (see the module docstring)
            return False, _describe(exc)

    # -- helpers -----------------------------------------------------------------------------
    def _laminar_release(self) -> None:
        st = self._laminar_state()
        held, st["held"], st["next"], st["touched"] = st["held"], None, None, False
        if held is not None and hasattr(held, "close"):
            held.close()  # drops the version's shared lock

    def _laminar_reload(self, held, weights=None, commit: bool = False) -> None:
        """reload_weights from a state dict, or from a relay version held through `weights` (its
        LocalWeights: the slot mapping is page-locked once per slot file; False without CUDA).
        `commit`: a commit's load (the test hook may cut it short)."""
        if isinstance(held, dict):
            tensors = iter(held.items())
        else:
            if weights is not None:
                weights.pin(held)
            tensors = held.tensors()
        try:
            self.model_runner.reload_weights(weights_iterator=self._laminar_faulty(tensors) if commit else tensors)
        except BaseException:
            _unwedge(self.model_runner)
            raise
        repack_cpu_experts(self.model_runner)

    def _laminar_restore(self, runs: tuple) -> None:
        """Reload the weights this rank ran before a failed commit."""
        if runs[0] == "model":
            try:
                self.model_runner.reload_weights()  # from the model folder, as at start
            except BaseException:
                _unwedge(self.model_runner)
                raise
            repack_cpu_experts(self.model_runner)
            return
        if runs[0] == "file":
            self._laminar_reload(_read_file(runs[1]))
            return
        _, shm_dir, name = runs
        weights = self._laminar_weights(shm_dir)
        pulled = weights.version(name)
        if pulled is None:
            raise RuntimeError(f"v{name[2]} is no longer in {shm_dir} as lineage {name[1]} (neither current nor "
                               f"retained: the relay's retain_versions keeps older ones; the same number of "
                               f"another lineage is other weights)")
        with pulled:
            self._laminar_reload(pulled, weights)

    def _laminar_fault(self, phase: str) -> None:
        """The test hook (module docstring): raise if the fault file names this rank and phase."""
        lines = _fault_lines()
        if lines and f"{self.laminar_rank()} {phase}" in lines:
            raise RuntimeError(f"test fault: rank {self.laminar_rank()} fails {phase} ({FAULT_ENV})")

    def _laminar_faulty(self, tensors):
        """`tensors`, raising after half of them when the test hook fails this rank's commit."""
        lines = _fault_lines()
        if not lines or f"{self.laminar_rank()} commit" not in lines:
            return tensors
        items = list(tensors)

        def cut():
            yield from items[: max(1, len(items) // 2)]
            raise RuntimeError(f"test fault: rank {self.laminar_rank()} fails its commit part-way ({FAULT_ENV})")
        return cut()


def _fault_lines() -> set[str]:
    path = os.environ.get(FAULT_ENV)
    if not path:
        return set()
    try:
        with open(path) as f:
            return {" ".join(line.split()) for line in f}
    except FileNotFoundError:
        return set()


def _read_file(path: str) -> dict:
    """A state dict saved with torch.save (tests, warm starts)."""
    import torch  # late: torch; configs validate without it
    return torch.load(path, map_location="cpu", weights_only=True)


def _unwedge(model_runner) -> None:
    """After reload_weights raised part-way: vLLM's layer-wise reload holds the layers that had
    not received all their tensors on the meta device, with their loaders wrapped. Finishing it
    puts every layer back on its own storage (the layers it finished hold new weights, the others
    old or partly new ones), so the model is whole again and can be reloaded."""
    if not hasattr(model_runner, "get_model"):
        return  # not vLLM's runner (a unit test's stand-in): nothing is held on the meta device
    # late: vLLM, loaded only in an engine process
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
    finalize_layerwise_reload(model_runner.get_model(), model_runner.vllm_config.model_config)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
