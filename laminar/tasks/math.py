"""Math answer verifier: extract the final answer of a response, check it with math-verify.

    reward: "laminar.tasks.math:math_reward"        # 1 correct, 0 otherwise
    reward: "laminar.tasks.math:dapo_math_reward"   # DAPO: +1 / -1, overlong shaping

Extraction (`extract_answer`): the content of the LAST `\\boxed{...}` (or `\\fbox{...}`, braces
matched, so `\\boxed{\\frac{1}{2}}` works); if there is none, the last line of the form
`Answer: X` (DAPO-Math-17k's format; trailing period and `$...$` dropped). `require_boxed` turns
the fallback off. Checking (`is_equivalent`) is math-verify's `parse` + `verify`, so equivalent
forms count: 7/8 = \\frac{7}{8} = 0.875, `x = 3` = 3, `3\\text{ cm}` = 3, 50\\% = 0.5, sets and
intervals up to order/spacing.

Never raising, never hanging: the reward of a response is computed on the rollout's event loop, so
a verifier error (math-verify or sympy raising) is a wrong answer, never an exception out, and
three guards bound the time: an answer longer than `MAX_ANSWER_CHARS` is not parsed; answers that
would make sympy build astronomically large numbers (power towers, factorials of factorials, huge
exponents — these hang in C code where no alarm can interrupt) are refused before parsing; and
in the main thread math-verify's own SIGALRM timeouts apply (it cannot use them elsewhere, so in
other threads only the first two guards do).

Shaping (`make_math_reward`): `correct` / `incorrect` values, `format_penalty` when no answer
can be extracted, and DAPO's soft overlong punishment: with L = spec.max_tokens and a buffer
B = overlong_buffer_frac * L, a response of n tokens gets an extra
`-overlong_penalty * min(1, (n - (L - B)) / B)` once n > L - B.
"""
from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

from laminar.datasets import HFTokenizer
from laminar.tasks.rewards import decode_bytes

log = logging.getLogger("laminar.tasks.math")

MAX_ANSWER_CHARS = 512
_BOX = re.compile(r"\\(?:boxed|fbox)\s*(\{)?")
_ANSWER_LINE = re.compile(r"^\s*(?:\*\*)?(?:final\s+)?answer(?:\*\*)?\s*[:：](?:\*\*)?\s*(.+?)\s*$", re.I | re.M)
# Inputs that make sympy compute enormous integers (C code: no timeout can stop it).
_EXPLOSIVE = re.compile(
    r"\^\s*\{[^{}]*\^"            # a^{b^c}: power tower
    r"|\^\s*\(?[\d.]+\)?\s*\^"    # a^b^c
    r"|\*\*[^*]*\*\*"             # a**b**c
    r"|\^\s*\{?\s*-?\d{5,}"       # exponent with 5+ digits
    r"|\*\*\s*\(?\s*-?\d{5,}"
    r"|!\s*\)?\s*!"               # (n!)! and n!!
    r"|\d{4,}\s*!"                # 1000!
    r"|\\(?:binom|choose)\s*\{?\s*\d{5,}")


def _braced(text: str, start: int) -> str | None:
    """The text between text[start] == '{' and its matching '}', or None if unbalanced."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c == "{" and text[i - 1] != "\\":
            depth += 1
        elif c == "}" and text[i - 1] != "\\":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` / `\\fbox{...}` (or `\\boxed 5`) in `text`."""
    for m in reversed(list(_BOX.finditer(text))):
        if m.group(1):
            inner = _braced(text, m.start(1))
            if inner is not None:
                return inner.strip()
        else:
            word = re.match(r"[^\s$]+", text[m.end():])
            if word:
                return word.group(0)
    return None


def answer_line(text: str) -> str | None:
    lines = _ANSWER_LINE.findall(text)
    if not lines:
        return None
    ans = lines[-1].strip().rstrip(".").strip()
    if len(ans) >= 2 and ans[0] == "$" and ans[-1] == "$":
        ans = ans.strip("$").strip()
    return ans or None


def extract_answer(text: str, require_boxed: bool = False) -> str | None:
    """The final answer of a response: last \\boxed{} content, else the last `Answer:` line."""
    boxed = last_boxed(text)
    if boxed is not None or require_boxed:
        return boxed or None
    return answer_line(text)


def _too_costly(s: str) -> bool:
    return len(s) > MAX_ANSWER_CHARS or _EXPLOSIVE.search(s) is not None


def is_equivalent(pred: str, gold: str, timeout_s: int = 2) -> bool:
    """True if the extracted answer `pred` is mathematically equal to the reference `gold`.

    Any error inside math-verify (or sympy) counts as not equivalent; never raises."""
    pred, gold = pred.strip(), str(gold).strip()
    if not pred or not gold or _too_costly(pred) or _too_costly(gold):
        return False
    if pred == gold:
        return True
    try:
        from math_verify import parse, verify  # late: math_verify (sympy, heavy), only when scoring
        t = timeout_s if threading.current_thread() is threading.main_thread() else None
        g = parse(f"${gold}$", parsing_timeout=t) or parse(gold, parsing_timeout=t)
        p = parse(f"${pred}$", parsing_timeout=t)
        if not g or not p:
            return False
        return bool(verify(g, p, timeout_seconds=t))
    except Exception as exc:  # noqa: BLE001 — a verifier failure is a wrong answer, by contract
        log.debug("math_verify_failed %r vs %r: %r", pred, gold, exc)
        return False


@dataclass(frozen=True)
class Grade:
    answer: str | None  # what was extracted (None: no answer found: a format failure)
    correct: bool


def grade(text: str, gold: str, require_boxed: bool = False) -> Grade:
    try:
        ans = extract_answer(text, require_boxed)
    except Exception:  # noqa: BLE001 — extraction is plain Python; kept total anyway
        ans = None
    return Grade(ans, ans is not None and is_equivalent(ans, gold))


def math_score(text: str, answer: str) -> float:
    """Text-level score (for environments): 1.0 if the final answer in `text` equals `answer`."""
    return 1.0 if grade(text, answer).correct else 0.0


def make_math_reward(correct: float = 1.0, incorrect: float = 0.0, format_penalty: float | None = None,
                     require_boxed: bool = False, overlong_buffer_frac: float = 0.0,
                     overlong_penalty: float = 1.0, tokenizer_dir: str | None = None) -> Callable:
    """A reward `(spec, response_tokens) -> float` with DAPO-style options (module docstring).

    `format_penalty`: reward when no answer can be extracted (None: same as `incorrect`).
    `tokenizer_dir`: a model folder whose tokenizer decodes the response (loaded on the first call;
    None: the tiny models' byte tokenizer)."""
    if not 0.0 <= overlong_buffer_frac < 1.0:
        raise ValueError(f"overlong_buffer_frac must be in [0, 1), got {overlong_buffer_frac}")
    no_answer = incorrect if format_penalty is None else format_penalty
    tokenizer: list = []

    def decode(tokens) -> str:
        if tokenizer_dir is None:
            return decode_bytes(tokens)
        if not tokenizer:
            tokenizer.append(HFTokenizer(tokenizer_dir))
        return tokenizer[0].decode(tokens)

    def reward(spec, response_tokens) -> float:
        g = grade(decode(response_tokens), spec.answer, require_boxed)
        r = correct if g.correct else (incorrect if g.answer is not None else no_answer)
        if overlong_buffer_frac > 0:
            limit = int(spec.max_tokens)
            buffer = overlong_buffer_frac * limit
            over = len(response_tokens) - (limit - buffer)
            if over > 0:
                r -= overlong_penalty * min(1.0, over / buffer)
        return float(r)

    return reward


math_reward = make_math_reward()
"""1.0 if the final answer (\\boxed{} or `Answer:` line) is equivalent to spec.answer, else 0.0."""

math_reward_boxed = make_math_reward(require_boxed=True)
"""Like math_reward, but only a \\boxed{} answer counts."""

dapo_math_reward = make_math_reward(correct=1.0, incorrect=-1.0, overlong_buffer_frac=0.2)
"""DAPO's rule reward: +1 / -1 (no answer: -1), soft overlong punishment over the last 20%
of spec.max_tokens (DAPO: a 4096-token buffer of 20480)."""

smollm2_math_reward = make_math_reward(tokenizer_dir="models/smollm2")
"""Like math_reward, for SmolLM2 (configs/smollm2-math.yaml): responses decoded with the tokenizer
of `models/smollm2` (relative to the working directory, as the configs' model_dir)."""


def make_math_answer(tokenizer_dir: str | None = None, require_boxed: bool = False) -> Callable:
    """The final answer `(spec, response_tokens) -> str | None` the evaluator's maj@k votes on:
    the \\boxed{} (or `Answer:` line) content, stripped; None when there is none."""
    tokenizer: list = []

    def answer(spec, response_tokens) -> str | None:
        if tokenizer_dir is None:
            text = decode_bytes(response_tokens)
        else:
            if not tokenizer:
                tokenizer.append(HFTokenizer(tokenizer_dir))
            text = tokenizer[0].decode(response_tokens)
        got = extract_answer(text, require_boxed)
        return got.strip() if got is not None else None

    return answer


math_answer = make_math_answer()
"""The answer math_reward grades (byte tokenizer of the tiny models)."""

smollm2_math_answer = make_math_answer(tokenizer_dir="models/smollm2")
"""The answer smollm2_math_reward grades (SmolLM2's tokenizer)."""
