"""Dataset loading: JSONL and Parquet, chat layouts, and errors that name the file and line."""
from __future__ import annotations

import json

import pytest

from laminar.datasets import ByteTokenizer, DatasetError, load_records


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_broken_row_names_file_and_line(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, "{not json", {"prompt": "c", "answer": "3"}])
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: not valid JSON"):
        load_records(p)
    recs, skipped = load_records(p, on_bad_row="skip")
    assert [r.prompt for r in recs] == ["a", "c"] and skipped == 1


def test_missing_field_names_line(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, {"question": "b", "answer": 2}])
    with pytest.raises(DatasetError, match=r"d\.jsonl: line 2: field 'prompt' missing"):
        load_records(p)


def test_parquet_and_chat_layout(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    rows = [{"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dapo.parquet")
    recs, _ = load_records(tmp_path, answer_field="reward_model.ground_truth")
    assert recs[0].prompt == "1+1?" and recs[0].answer == "2"


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids[0] == tok.bos_id and tok.decode(ids[1:] + [tok.eos_id, 50]) == "héllo"
