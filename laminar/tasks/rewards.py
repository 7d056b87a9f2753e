"""Rule-based rewards over byte-tokenized text (the tiny models' tokenizer: id = byte + 3)."""
from __future__ import annotations

EOS, OFFSET = 2, 3


def decode_bytes(tokens) -> str:
    out = bytearray()
    for t in tokens:
        t = int(t)
        if t == EOS:
            break
        if t >= OFFSET and t - OFFSET < 256:
            out.append(t - OFFSET)
    return out.decode("utf-8", errors="replace")


def exact_answer(spec, response_tokens) -> float:
    """1.0 if the response (up to EOS, stripped) equals the reference answer, else 0.0."""
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
