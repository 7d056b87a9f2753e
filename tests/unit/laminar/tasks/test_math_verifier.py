"""The math verifier: answer extraction, equivalence through math-verify, reward shaping, and that
garbage (unbalanced LaTeX, random bytes, inputs that would make sympy explode) is a fast 0."""
from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from laminar.protocol import TrajectorySpec
from laminar.tasks.math import (
    dapo_math_reward,
    extract_answer,
    grade,
    is_equivalent,
    make_math_reward,
    math_reward,
    math_reward_boxed,
    math_score,
)

pytest.importorskip("math_verify")


def tokens(text: str, eos: bool = True) -> list[int]:
    return [b + 3 for b in text.encode("utf-8")] + ([2] if eos else [])


def spec(answer: str, max_tokens: int = 256) -> TrajectorySpec:
    return TrajectorySpec(trajectory_id="t", prompt_id="p", group_id="g", sample_index=0, group_size=1,
                          prompt_tokens=np.zeros(1, np.int32), answer=answer, max_tokens=max_tokens)


EQUIVALENT = [
    ("7/8", "\\frac{7}{8}"), ("7/8", "0.875"), ("\\frac{7}{8}", "\\dfrac{7}{8}"), ("7/8", "\\frac78"),
    ("3", "x = 3"), ("3", "3\\text{ cm}"), ("3", "3 cm"), ("0.5", "50\\%"), ("1000", "1,000"),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"), ("\\{1,2\\}", "\\{2, 1\\}"), ("-1/2", "-\\frac{1}{2}"),
    ("3.5", "3.50"), ("34", "34"), ("10", "10^\\circ"),
]
NOT_EQUIVALENT = [("3", "4"), ("7/8", "8/7"), ("7/8", "0.87"), ("1/2", "-1/2"), ("2", "x = 3"),
                  ("\\sqrt{2}", "2"), ("34", "hello world"), ("5", "")]


@pytest.mark.parametrize("gold,pred", EQUIVALENT)
def test_equivalent_forms_count(gold, pred):
    assert is_equivalent(pred, gold)
    assert math_reward(spec(gold), tokens(f"Thus \\boxed{{{pred}}}.")) == 1.0


@pytest.mark.parametrize("gold,pred", NOT_EQUIVALENT)
def test_different_answers_do_not(gold, pred):
    assert not is_equivalent(pred, gold)
    assert math_reward(spec(gold), tokens(f"\\boxed{{{pred}}}")) == 0.0


def test_extraction_last_boxed_nested_braces_and_answer_line():
    assert extract_answer("first \\boxed{1}, finally \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert extract_answer("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert extract_answer("\\fbox{5}") == "5" and extract_answer("so \\boxed 5.") == "5."
    assert extract_answer("an unclosed \\boxed{\\frac{1}{2} and \\boxed{3}") == "3"
    assert extract_answer("work...\nAnswer: $x = 3$.") == "x = 3"
    assert extract_answer("Answer: 1\nmore\n**Answer:** 34") == "34"
    assert extract_answer("Answer: 34", require_boxed=True) is None
    assert extract_answer("\\boxed{}") is None and extract_answer("nothing here") is None
    # \boxed wins over an Answer: line; after an EOS comes the next turn of a multi-turn episode
    # (an agent's tool call, then its answer): every turn is read, the last answer counts
    assert extract_answer("\\boxed{7}\nAnswer: 8") == "7"
    assert math_reward(spec("7"), tokens("\\boxed{8}") + tokens("\\boxed{7}")) == 1.0
    assert math_reward(spec("8"), tokens("\\boxed{8}") + tokens("\\boxed{7}")) == 0.0


def test_reward_options_format_penalty_and_overlong():
    assert math_reward(spec("34"), tokens("Answer: 34")) == 1.0
    assert math_reward_boxed(spec("34"), tokens("Answer: 34")) == 0.0
    strict = make_math_reward(incorrect=-1.0, format_penalty=-2.0, require_boxed=True)
    assert strict(spec("34"), tokens("\\boxed{34}")) == 1.0
    assert strict(spec("34"), tokens("\\boxed{35}")) == -1.0
    assert strict(spec("34"), tokens("Answer: 34")) == -2.0
    assert dapo_math_reward(spec("34"), tokens("blah")) == -1.0
    # overlong: max 100 tokens, buffer 20: no penalty up to 80, linear to -1 at 100, capped beyond
    shaped = make_math_reward(overlong_buffer_frac=0.2)
    ok = tokens("\\boxed{34}", eos=False)
    pad = lambda n: ok + [3 + ord(" ")] * (n - len(ok))  # noqa: E731
    assert shaped(spec("34", 100), pad(80)) == 1.0
    assert shaped(spec("34", 100), pad(90)) == pytest.approx(0.5)
    assert shaped(spec("34", 100), pad(100)) == pytest.approx(0.0)
    assert shaped(spec("34", 100), pad(130)) == pytest.approx(0.0)
    with pytest.raises(ValueError):
        make_math_reward(overlong_buffer_frac=1.0)


EXPLOSIVE = ["9^{9^{9^{9}}}", "10^{10^{10}}", "2**2**2**40", "(100!)!", "123456!", "2^{1000000}", "10^9^9"]


@pytest.mark.parametrize("pred", EXPLOSIVE)
def test_inputs_that_would_hang_sympy_are_refused_fast(pred, monkeypatch):
    """Refused before parsing, not cut by a timeout: math-verify is never called for them."""
    import math_verify

    class ReachedParser(BaseException):  # not an Exception: the verifier's `except Exception` cannot hide it
        pass

    def must_not_parse(*a, **k):
        raise ReachedParser(f"{pred!r} reached math-verify's parser")
    monkeypatch.setattr(math_verify, "parse", must_not_parse)
    assert math_reward(spec("5"), tokens(f"\\boxed{{{pred}}}")) == 0.0
    assert not is_equivalent(pred, "5")


def test_garbage_never_raises():
    rng = random.Random(0)
    garbage = ["\\boxed{\\frac{", "\\boxed{{{{}", "\\boxed{\\left(}", "Answer: $$", "\\boxed{\\begin{matrix}}",
               "\\boxed{" + "(" * 300 + "}", "\\boxed{" + "1+" * 400 + "1}", "\\boxed{\x00\xff}",
               "\\boxed{\\sqrt[}{}", "Answer: \\", "\\boxed{x=}", "\\boxed{=}", "\\boxed{\\infty - \\infty}"]
    for g in garbage:
        assert math_reward(spec("3"), tokens(g)) in (0.0, 1.0)
        assert math_score(g, "\\frac{") == 0.0
    for _ in range(50):  # random byte-token responses (what an untrained tiny model writes)
        toks = [rng.randrange(0, 259) for _ in range(rng.randrange(0, 80))]
        assert math_reward(spec("3"), toks + tokens("\\boxed{3")) in (0.0, 1.0)
    assert math_reward(spec("3"), []) == 0.0
    assert math_reward(spec(""), tokens("\\boxed{3}")) == 0.0


def test_works_off_the_main_thread():
    out = {}
    t = threading.Thread(target=lambda: out.update(
        ok=grade("\\boxed{0.875}", "7/8").correct, bad=grade("\\boxed{9^{9^{9}}}", "7/8").correct))
    t.start()
    t.join(30)
    assert out == {"ok": True, "bad": False}
