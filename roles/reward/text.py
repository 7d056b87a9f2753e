"""Token ids -> text for scorers that read text (judge, HTTP service): the policy's tokenizer, or
the tiny models' byte tokenizer when none is named."""
from __future__ import annotations

from laminar.tasks.rewards import decode_bytes


class Decoder:
    """Decodes prompts and responses with the policy's tokenizer."""

    def __init__(self, tokenizer_dir: str | None):
        self.tok = None
        if tokenizer_dir is not None:
            from transformers import AutoTokenizer  # late: transformers costs seconds to import
            self.tok = AutoTokenizer.from_pretrained(tokenizer_dir)

    def __call__(self, tokens) -> str:
        ids = [int(t) for t in tokens]
        if self.tok is None:
            return decode_bytes(ids)
        return self.tok.decode(ids, skip_special_tokens=True)
