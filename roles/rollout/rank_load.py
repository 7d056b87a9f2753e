"""One weight version for every tensor-parallel rank of an engine: the driver of the three-phase
load whose worker side is roles/rollout/worker_ext.py.

    version = await load_on_ranks(call, ("relay", shm_dir, min_version, exact))
    await load_on_ranks(call, ("file", path))

`call(method, *args)` runs a worker-extension method on every rank and returns their answers in
rank order (vLLM's `collective_rpc`; unit tests pass a list of extension objects). Every answer is
(ok, value). The load:

1. prepare on every rank (each takes hold of the version: lock, mapping, MACs). A rank that fails
   -> every rank lets go, nothing was loaded: WeightsLoadError. Ranks that saw different newest
   versions (the relay committed one between their reads) -> all let go and prepare the newest
   of them by number, at most three times.
2. commit on every rank (each loads its shard).
3. settle: all committed -> each rank now runs the new version. Any rank failed -> every rank
   that touched its weights reloads the ones it ran (WeightsLoadError: the engine is back on its
   old version everywhere), or, if some rank could not get them back, WeightsLost: the engine's
   weights are unknown, and the caller must load a version before it generates again.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

Call = Callable[..., Awaitable[list]]
_ATTEMPTS = 3  # prepares per load when the ranks keep seeing different newest versions


class WeightsLoadError(RuntimeError):
    """A load that failed on some rank; every rank still runs the weights it had."""


class WeightsLost(RuntimeError):
    """A load failed part-way and some rank could not reload its old weights: the engine's weights
    are unknown until the next complete load."""


def _failures(answers: list) -> list[str]:
    return [f"rank {r}: {value}" for r, (ok, value) in enumerate(answers) if not ok]


async def load_on_ranks(call: Call, source: tuple) -> int:
    """Load `source` on every rank as one version (module docstring); the version loaded (0 for a
    file), or -1 when the relay has none newer than the source's min_version."""
    for _ in range(_ATTEMPTS):
        prepared = await call("laminar_prepare", source)
        failed = _failures(prepared)
        versions = {int(v) for ok, v in prepared if ok}
        if failed or len(versions) != 1:
            await call("laminar_settle", False)  # nothing was touched: every rank lets go
            if failed:
                raise WeightsLoadError(f"prepare failed ({'; '.join(failed)}); every rank keeps its weights")
            source = (*source[:3], max(versions))  # all ranks take the newest one seen
            continue
        version = versions.pop()
        if version < 0:
            await call("laminar_settle", False)
            return -1
        failed = _failures(await call("laminar_commit"))
        if not failed:
            await call("laminar_settle", True)
            return version
        lost = _failures(await call("laminar_settle", False))  # every touched rank reloads its old weights
        if lost:
            raise WeightsLost(f"commit of v{version} failed ({'; '.join(failed)}) and the old weights could not "
                              f"be reloaded ({'; '.join(lost)}): the engine's weights are unknown")
        raise WeightsLoadError(f"commit of v{version} failed ({'; '.join(failed)}); every rank reloaded the "
                               f"weights it had")
    raise WeightsLoadError(f"the ranks saw different newest versions {_ATTEMPTS} times (the relay kept "
                           f"committing); every rank keeps its weights")
