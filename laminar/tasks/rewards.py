"""Rule-based rewards over byte-tokenized text (the tiny models' tokenizer: id = byte + 3)."""
from __future__ import annotations

EOS, OFFSET = 2, 3


def decode_bytes(tokens) -> str:
    """The text of byte tokens. EOS ends a turn: a single-turn response reads up to its EOS; the
    policy tokens of a multi-turn episode (an agent's or an environment's: each turn the policy
    wrote ends with EOS, the observations between them masked out) read as every turn, joined by
    a newline, so a verifier sees the final turn's answer and not only the first turn."""
    turns = [bytearray()]
    for t in tokens:
        t = int(t)
        if t == EOS:
            turns.append(bytearray())
        elif t >= OFFSET and t - OFFSET < 256:
            turns[-1].append(t - OFFSET)
    if len(turns) > 1 and not turns[-1]:
        turns.pop()  # what follows the last EOS: nothing
    return b"\n".join(turns).decode("utf-8", errors="replace")


def exact_answer(spec, response_tokens) -> float:
    """1.0 if the response (its text as decode_bytes reads it, stripped) equals the reference answer, else 0.0."""
    return 1.0 if decode_bytes(response_tokens).strip() == spec.answer.strip() else 0.0


def zero(spec, response_tokens) -> float:
    return 0.0


def upper_fraction(spec, response_tokens) -> float:
    """Share of uppercase ASCII letters among the reply's letters (0 for a reply without any):
    the demo's verifiable task ("shout about a topic"). Length-neutral: a longer reply neither
    earns nor costs more, so RL changes what the model says, not how long it talks."""
    text = decode_bytes(response_tokens)
    letters = [c for c in text if c.isascii() and c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters) if letters else 0.0
