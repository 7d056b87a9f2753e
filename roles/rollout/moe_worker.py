"""Mixture-of-experts support inside a vLLM worker process (the worker extension calls it).

RoutingCapture: the experts the engine itself routes each token to, on the CPU build.
vLLM 0.32 returns routed experts only through its AuxOutput connector
(`enable_return_routed_experts`), which needs Model Runner V2 and so Triton, which the CPU build
lacks. So the capture sits where vLLM's own capturer would bind: every MoE layer's router (a
`BaseRouter`, the CPU build's `CPURouter`) calls `capture_fn(topk_ids)` with the logical expert ids
of every token of the step, right after its top-k, before any expert-parallel remapping. Those are
the ids the expert kernel then runs: the engine's routing, not a second computation of it.

Mapping rows to requests: the model runner lays a step's tokens out request after request in its
input batch's order, `num_scheduled_tokens[i]` tokens of request i starting at its
`num_computed_tokens` (the token's position). The capture wraps the runner's `_prepare_inputs` to
note that layout before the forward; the rows of the step are committed to their requests at the
next step (or at the next `take`), once every MoE layer reported. A forward without a layout
(vLLM's warm-up and profiling runs) is ignored.

Each request's rows are positions [0, n) of its prompt + output (a request always prefills from
position 0: capture runs with prefix caching off, roles/rollout/engine.py). `take` answers the
rows a client asks for, by the client's request id (vLLM appends `-<8 characters>` to it), as raw
bytes; memory is bounded: finished requests (the scheduler's `finished_req_ids`, aborts included)
are kept for `keep_finished` more, the oldest dropped first, and a client drops those it is done with.

repack_cpu_experts: a vLLM 0.32 CPU-build bug this module works around. Loading weights in place
(`reload_weights`) re-runs the MoE method's process_weights_after_loading, which on a weight update
skips the expert kernel's own step (`fused_experts.process_weights_after_loading`): the CPU kernel's
prepack of w13/w2 into its grouped-gemm layout. The kernel then reads plain weights as packed ones
(checked: greedy tokens survive, logprobs move by ~0.1). Calling that step after every in-place
load restores the layout (tests/integration/rollout/test_moe_vllm.py checks a reload of the same weights
leaves every logprob unchanged).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from laminar.models.routing import routing_dtype

KEEP_FINISHED = 4096  # finished requests whose rows are kept until their client takes them


class _Rows:
    """One request's rows: positions [0, n) filled, in a buffer grown by doubling."""

    def __init__(self, layers: int, top_k: int, dtype):
        self.buf = np.zeros((64, layers, top_k), dtype)
        self.n = 0
        self.gaps = 0

    def write(self, start: int, block: np.ndarray) -> None:
        if start > self.n:  # positions never seen before it (a prefix served from a cache): unusable
            self.gaps += 1
            return
        end = start + len(block)
        if end > len(self.buf):
            grown = np.zeros((max(end, 2 * len(self.buf)), *self.buf.shape[1:]), self.buf.dtype)
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        self.buf[start:end] = block
        self.n = max(self.n, end)


class RoutingCapture:
    """The routing of every token the engine runs, per request and position (module docstring)."""

    def __init__(self, model_runner, keep_finished: int = KEEP_FINISHED):
        self.runner, self.keep_finished = model_runner, keep_finished
        self.layer_index: dict[int, int] = {}   # MoE layer id -> its place on the rows' layer axis
        self.top_k = self.experts = 0
        self.dtype = np.dtype(np.uint8)
        self.step: tuple[list[str], list[int], list[int]] | None = None  # the running step's layout
        self.captured: dict[int, np.ndarray] = {}
        self.requests: dict[str, _Rows] = {}
        self.external: dict[str, str] = {}       # client request id -> vLLM's
        self.finished: OrderedDict[str, None] = OrderedDict()
        self.steps = self.incomplete_steps = 0

    def install(self) -> dict:
        """Bind to every MoE layer's router and to the runner's input preparation; what the rows
        hold (layers, top_k, experts). ValueError when the model has no router this can bind."""
        # late: vLLM, loaded only in an engine process
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
        runners = [m for m in self.runner.get_model().modules() if isinstance(m, MoERunner)]
        if not runners:
            raise ValueError("routing capture: the model has no mixture-of-experts layer")
        bad = [type(m.router).__name__ for m in runners if not isinstance(m.router, BaseRouter)]
        if bad:
            raise ValueError(f"routing capture: router {bad[0]} does not report its top-k (not a BaseRouter)")
        ids = sorted({int(m.layer_id) for m in runners})
        self.layer_index = {lid: i for i, lid in enumerate(ids)}
        self.top_k = int(runners[0].router.top_k)
        self.experts = int(runners[0].router.global_num_experts)
        self.dtype = routing_dtype(self.experts)
        for m in runners:
            m.router.set_capture_fn(self._capturer(self.layer_index[int(m.layer_id)]))
        prepare = self.runner._prepare_inputs

        def prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
            self._begin(scheduler_output, num_scheduled_tokens)
            return prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)

        self.runner._prepare_inputs = prepare_inputs  # this runner only (an instance attribute)
        return {"layers": len(ids), "top_k": self.top_k, "experts": self.experts, "dtype": self.dtype.str}

    def _capturer(self, index: int):
        def capture(topk_ids) -> None:
            if self.step is not None:
                self.captured[index] = topk_ids.detach().to("cpu").numpy().copy()
        return capture

    def _begin(self, scheduler_output, num_scheduled_tokens) -> None:
        """A step is about to run: commit the previous one, note this one's layout, retire the
        requests the scheduler finished."""
        self._commit()
        batch = self.runner.input_batch
        n = batch.num_reqs
        self.step = (list(batch.req_ids[:n]), [int(x) for x in num_scheduled_tokens[:n]],
                     [int(x) for x in batch.num_computed_tokens_cpu[:n]])
        for rid in getattr(scheduler_output, "finished_req_ids", ()) or ():
            if rid in self.requests:
                self.finished[rid] = None
        while len(self.finished) > self.keep_finished:
            self._forget(self.finished.popitem(last=False)[0])

    def _commit(self) -> None:
        step, captured, self.step, self.captured = self.step, self.captured, None, {}
        if step is None:
            return
        if len(captured) != len(self.layer_index):
            self.incomplete_steps += 1  # a step that never ran its forward (nothing to route)
            return
        rows = np.stack([captured[i] for i in range(len(self.layer_index))], axis=1).astype(self.dtype)
        self.steps += 1
        off = 0
        for rid, count, start in zip(*step, strict=True):
            r = self.requests.get(rid)
            if r is None:
                r = self.requests[rid] = _Rows(len(self.layer_index), self.top_k, self.dtype)
                self.external[_client_id(rid)] = rid
            r.write(start, rows[off:off + count])
            off += count

    def _forget(self, rid: str) -> None:
        self.requests.pop(rid, None)
        self.finished.pop(rid, None)
        if self.external.get(_client_id(rid)) == rid:
            del self.external[_client_id(rid)]

    def take(self, asks: list, drop: list) -> list:
        """For each (client request id, start, end): (start, rows, raw bytes) of the rows held in
        positions [start, end), or None when none is held; then forget the requests in `drop`."""
        self._commit()
        out = []
        for client_id, start, end in asks:
            r = self.requests.get(self.external.get(client_id, ""))
            stop = min(int(end), r.n) if r is not None else 0
            out.append((int(start), stop - int(start), r.buf[int(start):stop].tobytes())
                       if stop > int(start) else None)
        for client_id in drop:
            rid = self.external.get(client_id)
            if rid is not None:
                self._forget(rid)
        return out


def _client_id(rid: str) -> str:
    """The client's request id of vLLM's `<id>-<8 characters>`."""
    head, sep, tail = rid.rpartition("-")
    return head if sep and len(tail) == 8 else rid


def repack_cpu_experts(model_runner) -> int:
    """After an in-place weight load: the CPU expert kernels' own weight step, which vLLM 0.32
    skips on a weight update (module docstring); how many layers were repacked (0 off the CPU
    build, or when no layer uses a prepacking CPU kernel)."""
    if not hasattr(model_runner, "get_model"):
        return 0  # not vLLM's runner (a unit test's stand-in)
    try:
        # late: vLLM, loaded only in an engine process
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return 0
    done = 0
    for m in model_runner.get_model().modules():
        kernel = getattr(getattr(m, "quant_method", None), "moe_kernel", None)
        impl = getattr(kernel, "impl", None)
        experts = getattr(kernel, "fused_experts", None) or getattr(impl, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and hasattr(m, "w13_weight"):
            experts.process_weights_after_loading(m)
            done += 1
    return done
