"""Rule rewards over a multi-turn response: an agent's (or an environment's) episode scores the
policy's tokens of every turn, each turn ended by EOS; the verifier must see them all, the
final answer being in the last turn, and a single-turn response reads as before."""
from __future__ import annotations

import numpy as np

from laminar.protocol import TrajectorySpec
from laminar.tasks.math import math_reward
from laminar.tasks.rewards import EOS, OFFSET, decode_bytes, exact_answer


def enc(text: str) -> list[int]:
    return [b + OFFSET for b in text.encode()]


def spec(answer: str) -> TrajectorySpec:
    return TrajectorySpec(trajectory_id="t/0", prompt_id="t", group_id="t", sample_index=0, group_size=1,
                          prompt_tokens=np.array([5], dtype=np.int32), answer=answer, max_tokens=64)


def test_every_turn_is_read_and_the_last_answer_counts():
    # the calculator agent's episode: a tool call (turn 1), then the answer (turn 2); the tool's
    # reply between them is masked out of the policy tokens
    policy = enc('<tool_call>{"name": "calculator", "arguments": {"expression": "9 + 4"}}</tool_call>') + [EOS] \
        + enc("The answer is \\boxed{13}.") + [EOS]
    text = decode_bytes(policy)
    assert text.endswith("The answer is \\boxed{13}.") and text.startswith("<tool_call>")
    assert math_reward(spec("13"), policy) == 1.0
    assert math_reward(spec("12"), policy) == 0.0


def test_a_single_turn_reads_as_before():
    assert decode_bytes(enc("abc\n") + [EOS]) == "abc\n"
    assert decode_bytes(enc("abc")) == "abc"
    assert decode_bytes([EOS]) == ""
    assert exact_answer(spec("42"), enc(" 42 ") + [EOS]) == 1.0
