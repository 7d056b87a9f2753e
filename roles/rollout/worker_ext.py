"""vLLM worker extension: methods that run *inside* the engine's worker process.

vLLM's async engine runs the model in another process, and tensors passed through
`collective_rpc` arrive as lists there (`'list' object has no attribute 'dtype'`). So the worker
reads the weights itself: from the host relay's shared memory (zero-copy views,
laminar/weights/pull.py) or from a file, and hands them to `model_runner.reload_weights`.

One `LocalWeights` per relay folder lives as long as the worker: its slot mappings are cached
(no page-table set-up per version) and, on a GPU, each slot file's mapping is page-locked with
CUDA once (`LocalWeights.pin`), so every later version in the same file reaches the GPU at pinned
speed inside reload_weights. Without CUDA (the CPU build) pin() does nothing.
"""
from __future__ import annotations


class LaminarWorkerExtension:
    def _laminar_weights(self, shm_dir: str):
        """The worker's LocalWeights of one relay folder (made on first use, then kept)."""
        from laminar.weights.pull import LocalWeights
        held = self.__dict__.setdefault("_laminar_local_weights", {})
        weights = held.get(shm_dir)
        if weights is None:
            weights = held[shm_dir] = LocalWeights(shm_dir)
        return weights

    def laminar_load_relay(self, shm_dir: str, min_version: int, exact: int | None = None) -> int:
        """Load the relay's newest complete version if it is newer than min_version (or exactly
        version `exact`, the newest or a retained one); its number or -1."""
        w = self._laminar_weights(shm_dir)
        pulled = w.latest(min_version) if exact is None else w.version(exact)
        if pulled is None:
            return -1
        try:
            w.pin(pulled)  # page-locked once per slot file (False without CUDA: pageable copies)
            self.model_runner.reload_weights(weights_iterator=pulled.tensors())
            return pulled.manifest.version
        finally:
            pulled.close()

    def laminar_load_file(self, path: str) -> int:
        """Load a state dict saved with torch.save (tests, warm starts); number of tensors."""
        import torch
        sd = torch.load(path, map_location="cpu", weights_only=True)
        self.model_runner.reload_weights(weights_iterator=iter(sd.items()))
        return len(sd)
