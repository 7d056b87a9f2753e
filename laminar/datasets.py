"""Datasets for the prompt pool: local JSONL / Parquet files (or a folder of them) and tokenizers.

A record needs a prompt field and a verifier field (the reference answer); names are settings.
A malformed row raises DatasetError naming the file and the line (1-based; the row index for
Parquet), or is skipped and counted when `on_bad_row="skip"`. Nothing is downloaded: a model
folder with tokenizer files uses transformers' AutoTokenizer (local files only); otherwise the
byte tokenizer of the tiny test models is used.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import structlog

log = structlog.get_logger("laminar.datasets")


class DatasetError(ValueError):
    pass


@dataclass(frozen=True)
class Record:
    prompt_id: str
    prompt: str
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
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.eos_id = self.tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(model_dir: str | None):
    if model_dir and any((Path(model_dir) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return HFTokenizer(model_dir)
    return ByteTokenizer()


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".jsonl", ".json", ".parquet"))
        if not files:
            raise DatasetError(f"{path}: no .jsonl or .parquet files in this folder")
        return files
    if not path.exists():
        raise DatasetError(f"{path}: dataset file not found")
    return [path]


def _rows(path: Path) -> Iterator[tuple[int, object]]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield i, row
        return
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                yield lineno, DatasetError(f"{path}:{lineno}: not valid JSON: {exc.msg}")


def _field(row: dict, dotted: str):
    v = row
    for part in dotted.split("."):
        if not isinstance(v, dict) or part not in v:
            return None
        v = v[part]
    return v


def load_records(path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer",
                 id_field: str | None = None, on_bad_row: str = "error") -> tuple[list[Record], int]:
    """All records of a file or folder, and how many bad rows were skipped."""
    if on_bad_row not in ("error", "skip"):
        raise DatasetError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    records, skipped = [], 0
    for file in _files(Path(path)):
        where = "row" if file.suffix == ".parquet" else "line"
        for n, row in _rows(file):
            err = None
            if isinstance(row, DatasetError):
                err = str(row)
            elif not isinstance(row, dict):
                err = f"{file}:{n}: expected an object, got {type(row).__name__}"
            else:
                prompt, answer = _field(row, prompt_field), _field(row, answer_field)
                if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
                    prompt = prompt[-1].get("content")  # chat layout (e.g. DAPO-Math-17k)
                if not isinstance(prompt, str):
                    err = f"{file}: {where} {n}: field {prompt_field!r} missing or not a string"
                elif not isinstance(answer, (str, int, float)):
                    err = f"{file}: {where} {n}: field {answer_field!r} missing or not a string/number"
            if err:
                if on_bad_row == "error":
                    raise DatasetError(err)
                skipped += 1
                log.warning("bad_dataset_row_skipped", error=err)
                continue
            pid = str(_field(row, id_field)) if id_field and _field(row, id_field) is not None else str(len(records))
            records.append(Record(prompt_id=pid, prompt=prompt, answer=str(answer)))
    if not records:
        raise DatasetError(f"{path}: no usable records")
    return records, skipped
