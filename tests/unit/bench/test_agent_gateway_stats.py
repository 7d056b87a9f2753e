"""bench/agent_gateway.py's arithmetic: the median of the rounds' gateway/direct ratios, how far they
scatter, each round's value in the order the rounds ran, and the median CPU per call of each side."""
from __future__ import annotations

import pytest

from tests import support

pytestmark = pytest.mark.timeout(60)


def load_bench():
    return support.load_bench("agent_gateway")


def row(gateway: float, direct: float, agents_cpu: float = 3.0) -> dict:
    return {"gateway_tokens_per_s": gateway, "direct_tokens_per_s": direct, "gateway_over_direct": gateway / direct,
            "gateway_cpu_ms_per_call": {"agents": agents_cpu, "here": 2.0, "engine": 20.0},
            "direct_cpu_ms_per_call": {"here": 1.0, "engine": 18.0}}


def test_gateway_over_direct_is_the_median_round_with_its_spread():
    bench = load_bench()
    rows = [row(900, 1000, 3.0), row(800, 1000, 5.0), row(1900, 2000, 4.0), row(850, 1000, 1.0), row(1000, 1000, 2.0)]
    s = bench.summary(rows)
    assert s["gateway_over_direct"] == pytest.approx(0.9)  # the median round, not a mean of rates
    assert s["gateway_over_direct_rounds"] == pytest.approx([0.9, 0.8, 0.95, 0.85, 1.0])
    assert s["gateway_over_direct_range"] == pytest.approx([0.8, 1.0])
    assert s["gateway_over_direct_spread"] == pytest.approx(0.2 / 0.9)
    assert s["gateway_over_direct_iqr"] == pytest.approx((0.95 - 0.85) / 0.9)
    assert s["gateway_tokens_per_s"] == 900 and s["direct_tokens_per_s"] == 1000
    assert s["gateway_cpu_ms_per_call"] == {"agents": 3.0, "here": 2.0, "engine": 20.0}  # each one's median
    assert s["direct_cpu_ms_per_call"] == {"here": 1.0, "engine": 18.0}


def test_one_round_has_no_spread():
    s = load_bench().summary([row(700, 1000)])
    assert s["gateway_over_direct"] == pytest.approx(0.7)
    assert s["gateway_over_direct_spread"] == 0.0 and s["gateway_over_direct_iqr"] == 0.0


class RecordingEngine:
    """Stands in for the engine in this test of the replay's arithmetic only: records each request
    and answers with as many tokens as it was asked for."""

    def __init__(self):
        self.asked = []

    async def generate(self, request_id, prompt, max_tokens, seed, sampling):
        self.asked.append((list(prompt), max_tokens, seed, sampling.ignore_eos, sampling.whole))
        yield [7] * max_tokens, [0.0] * max_tokens, "length"


def test_the_direct_side_replays_each_call_on_its_context_to_the_length_it_had():
    import asyncio
    from types import SimpleNamespace

    import numpy as np
    bench = load_bench()
    # a prompt of 3 tokens; call 0 sampled 4 tokens, then an observation of 2, then call 1 sampled 3 (one an end token)
    traj = SimpleNamespace(spec=SimpleNamespace(prompt_tokens=np.array([1, 2, 3])),
                           response_tokens=np.array([10, 11, 12, 13, 20, 21, 30, 31, 2]),
                           obs_spans=np.array([[0, 0], [4, 6]]))
    engine = RecordingEngine()
    wall, tokens = asyncio.run(bench.direct_round(engine, {"e": traj}, [{"id": "e", "seeds": [5, 6]}]))
    # asked for whole, as the gateway's non-streamed calls without stop strings ask the engine
    assert engine.asked == [([1, 2, 3], 4, 5, True, True), ([1, 2, 3, 10, 11, 12, 13, 20, 21], 3, 6, True, True)]
    assert tokens == 7 and wall >= 0


def test_each_call_length_has_its_ratio_and_the_fixed_cost_is_told_apart_from_the_per_token_one():
    bench = load_bench()

    def at(mt: int, ratio: float, here_gw: float, here_direct: float, tokens: float) -> dict:
        r = row(1000 * ratio, 1000)
        r.update(max_tokens=mt, gateway_tokens_per_call=tokens,
                 gateway_cpu_ms_per_call={"agents": 5.0, "here": here_gw, "engine": 20.0},
                 direct_cpu_ms_per_call={"here": here_direct, "engine": 20.0})
        return r
    # the gateway's own CPU per call over the direct side's: 2 ms fixed + 0.01 ms per token
    rows = [at(64, 0.8, 3.64, 1.0, 64), at(64, 0.82, 3.64, 1.0, 64),
            at(256, 0.9, 5.56, 1.0, 256), at(256, 0.94, 5.56, 1.0, 256)]
    s = bench.by_max_tokens(rows, [64, 256])
    assert s["gateway_over_direct"] == pytest.approx(0.81)      # the first length's: the default one
    assert s["gateway_over_direct_by_max_tokens"] == pytest.approx({"64": 0.81, "256": 0.92})
    assert s["by_max_tokens"]["256"]["gateway_over_direct_rounds"] == pytest.approx([0.9, 0.94])
    assert s["path_cpu_ms_per_call_by_max_tokens"] == pytest.approx({"64": 2.64, "256": 4.56})
    assert s["path_cpu_ms_fixed_per_call"] == pytest.approx(2.0)
    assert s["path_cpu_ms_per_token"] == pytest.approx(0.01)
    one = bench.by_max_tokens(rows[:2], [64])
    assert one["gateway_over_direct"] == pytest.approx(0.81) and "path_cpu_ms_per_token" not in one


def test_the_conversation_must_fit_the_model_and_the_prompt_pool_budget():
    bench = load_bench()
    need = bench.context_need(6, 256)
    assert need["context"] > 6 * 256 and need["response"] < need["context"]
    assert need["context"] <= bench.MAX_MODEL_LEN and need["response"] <= bench.RESPONSE_BUDGET  # fits: 6 x 256
    with pytest.raises(SystemExit, match="--max-tokens 512"):
        bench.check_fits(6, [64, 512])
