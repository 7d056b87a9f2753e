"""Datasets for the prompt pool: local JSONL / Parquet files (or a folder of them) and tokenizers.

A record needs a prompt field and a verifier field (the reference answer); names are settings
(dotted for nested fields). A chat-layout prompt — a list of {role, content} messages, as
DAPO-Math-17k has — keeps its messages; its `prompt` text is the last message's.
A malformed row (bad JSON, a missing field, a wrong type) raises DatasetError naming the file and
the line (1-based; "row i", 0-based, for Parquet), or is skipped and counted when
`on_bad_row="skip"`. Prompt ids must be unique: group ids are built from them.

Tokenizing is a separate step so the prompt pool holds token ids only, and it is where a chat
template applies, once (`prompt_encoder`; the prompt pool and the evaluator call it): an
instruction-tuned model was tuned on conversations in its template, so a prompt is rendered as one
(an optional system prompt, the row's messages or one user turn with its text, then the assistant's
turn opened: the generation prompt) and the rendered text is encoded without adding special tokens
(the template writes the ones the model expects). `chat_template` is `auto` (the tokenizer folder's
own template when it has one, else plain text), `none` (plain text, as before templates), or the
path of a Jinja template file. The reward never sees the template: it scores the response tokens.
Nothing is downloaded: a model folder with tokenizer files uses transformers' AutoTokenizer
(local files only, imported lazily); otherwise the byte tokenizer of the tiny test models is used.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog
from pydantic import Field

log = structlog.get_logger("laminar.datasets")


class DatasetError(ValueError):
    pass


@dataclass(frozen=True)
class Record:
    """One dataset row: its id, its prompt text, its reference answer (and a chat layout's messages)."""
    prompt_id: str
    prompt: str
    answer: str
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) of a chat-layout prompt


@dataclass(frozen=True)
class PromptRecord:
    """What the prompt pool hands out: a record with its prompt as token ids."""
    prompt_id: str
    prompt_tokens: np.ndarray  # int32
    answer: str


class ByteTokenizer:
    """pad=0, bos=1, eos=2, byte b -> b + 3 (vocab 259): the tiny models' tokenizer."""
    pad_id, bos_id, eos_id, offset, vocab_size = 0, 1, 2, 3, 259

    def encode(self, text: str) -> list[int]:
        return [self.bos_id] + [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        out = bytearray()
        for t in ids:
            t = int(t)
            if t == self.eos_id:
                break
            if self.offset <= t < self.offset + 256:
                out.append(t - self.offset)
        return out.decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, model_dir: str):
        from transformers import AutoTokenizer  # late: transformers (heavy), only for a real tokenizer
        self.tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.eos_id = self.tok.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir: str | None):
    if model_dir and any((Path(model_dir) / f).exists() for f in TOKENIZER_FILES):
        return HFTokenizer(model_dir)
    return ByteTokenizer()


def chat_template_field():
    """The `chat_template` setting of a role that tokenizes prompts (prompt pool, evaluator)."""
    return Field("auto", description="render each prompt with a chat template where it is tokenized: auto (the "
                 "tokenizer folder's own template when it has one, else plain text), none (plain text), or the "
                 "path of a Jinja chat template file; the generation prompt (the assistant's turn) is added")


def system_prompt_field():
    """The `system_prompt` setting that goes with `chat_template`."""
    return Field(None, description="a system message put before each prompt's messages (a row with a system "
                 "message of its own keeps that one); needs a chat template")


class PromptEncoder:
    """Records -> prompt token ids: the prompt text as it is, or a conversation rendered by a chat template."""

    def __init__(self, tokenizer, template: str | None = None, system_prompt: str | None = None,
                 use_own_template: bool = False):
        self.tokenizer, self.template, self.system_prompt = tokenizer, template, system_prompt
        self.templated = use_own_template or template is not None

    def messages(self, rec: Record) -> list[dict]:
        msgs = [{"role": r, "content": c} for r, c in rec.messages] if rec.messages else \
            [{"role": "user", "content": rec.prompt}]
        if self.system_prompt is not None and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def render(self, rec: Record) -> str | None:
        """The templated text of `rec` (None without a template)."""
        if not self.templated:
            return None
        return self.tokenizer.tok.apply_chat_template(self.messages(rec), chat_template=self.template,
                                                      tokenize=False, add_generation_prompt=True)

    def encode(self, rec: Record) -> np.ndarray:
        text = self.render(rec)
        if text is None:
            return np.asarray(self.tokenizer.encode(rec.prompt), dtype=np.int32)
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False), dtype=np.int32)


def prompt_encoder(tokenizer_dir: str | None, chat_template: str = "auto",
                   system_prompt: str | None = None) -> PromptEncoder:
    """The encoder of the settings `tokenizer_dir`, `chat_template` (auto | none | PATH) and
    `system_prompt`; a setting that cannot apply raises DatasetError naming it."""
    tok = load_tokenizer(tokenizer_dir)
    own = isinstance(tok, HFTokenizer) and bool(getattr(tok.tok, "chat_template", None))
    if chat_template == "none":
        template, use_own = None, False
    elif chat_template == "auto":
        template, use_own = None, own
    else:
        path = Path(chat_template)
        if not path.is_file():
            raise DatasetError(f"chat_template: {path}: no such template file (or use auto or none)")
        if not isinstance(tok, HFTokenizer):
            raise DatasetError(f"chat_template {path}: needs a tokenizer_dir with a Hugging Face tokenizer (the "
                               "byte tokenizer has no special tokens to render a conversation with)")
        template, use_own = path.read_text(encoding="utf-8"), False
    if system_prompt is not None and template is None and not use_own:
        raise DatasetError(f"system_prompt is set but prompts are plain text (chat_template {chat_template!r}, "
                           f"tokenizer_dir {tokenizer_dir!r} without a chat template): set chat_template to a file")
    return PromptEncoder(tok, template, system_prompt, use_own)


def tokenize_records(records: list[Record], encoder) -> list[PromptRecord]:
    """Records with their prompt token ids (`encoder`: a PromptEncoder, or a tokenizer for plain text)."""
    if not isinstance(encoder, PromptEncoder):
        encoder = PromptEncoder(encoder)
    return [PromptRecord(r.prompt_id, encoder.encode(r), r.answer) for r in records]


SUFFIXES = (".jsonl", ".json", ".parquet")


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES)
        if not files:
            raise DatasetError(f"{path}: no .jsonl or .parquet files in this folder")
        return files
    if not path.exists():
        raise DatasetError(f"{path}: dataset file not found")
    if path.suffix not in SUFFIXES:
        raise DatasetError(f"{path}: unknown dataset format (expected one of {', '.join(SUFFIXES)})")
    return [path]


def _rows(path: Path) -> Iterator[tuple[int, object]]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # late: pyarrow (heavy), only for a parquet file
        except ImportError:
            raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        yield from enumerate(pq.read_table(path).to_pylist())
        return
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                yield lineno, DatasetError(f"{path}: line {lineno}: not valid JSON: {exc.msg}")


def _field(row: dict, dotted: str):
    v = row
    for part in dotted.split("."):
        if not isinstance(v, dict) or part not in v:
            return None
        v = v[part]
    return v


def _record(row: object, here: str, prompt_field: str, answer_field: str, id_field: str | None,
            default_id: str) -> Record:
    if isinstance(row, DatasetError):
        raise row
    if not isinstance(row, dict):
        raise DatasetError(f"{here}: expected an object, got {type(row).__name__}")
    prompt, answer = _field(row, prompt_field), _field(row, answer_field)
    messages = None
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):  # chat layout (e.g. DAPO-Math-17k)
        messages = _messages(prompt, here, prompt_field)
        prompt = messages[-1][1]
    if not isinstance(prompt, str):
        raise DatasetError(f"{here}: field {prompt_field!r} missing or not a string")
    if not isinstance(answer, (str, int, float)):
        raise DatasetError(f"{here}: field {answer_field!r} missing or not a string/number")
    pid = _field(row, id_field) if id_field else default_id
    if pid is None:
        raise DatasetError(f"{here}: field {id_field!r} missing")
    return Record(prompt_id=str(pid), prompt=prompt, answer=str(answer), messages=messages)


def _messages(msgs: list, here: str, prompt_field: str) -> tuple[tuple[str, str], ...]:
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise DatasetError(f"{here}: field {prompt_field!r}: message {i} has no string content")
        out.append((str(m.get("role", "user")), m["content"]))
    return tuple(out)


def load_records(path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer",
                 id_field: str | None = None, on_bad_row: str = "error") -> tuple[list[Record], int]:
    """All records of a file or folder, and how many bad rows were skipped."""
    if on_bad_row not in ("error", "skip"):
        raise DatasetError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    records: list[Record] = []
    seen: dict[str, str] = {}  # prompt id -> where it was first seen
    skipped = 0
    for file in _files(Path(path)):
        where = "row" if file.suffix == ".parquet" else "line"
        for n, row in _rows(file):
            here = f"{file}: {where} {n}"
            try:
                rec = _record(row, here, prompt_field, answer_field, id_field, str(len(records)))
                if rec.prompt_id in seen:
                    raise DatasetError(f"{here}: prompt id {rec.prompt_id!r} repeats the one at {seen[rec.prompt_id]}")
            except DatasetError as exc:
                if on_bad_row == "error":
                    raise
                skipped += 1
                log.warning("bad_dataset_row_skipped", error=str(exc))
                continue
            seen[rec.prompt_id] = here
            records.append(rec)
    if not records:
        raise DatasetError(f"{path}: no usable records")
    return records, skipped
