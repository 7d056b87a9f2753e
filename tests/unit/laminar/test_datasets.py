"""Dataset loading: JSONL, Parquet and folders, chat layouts, errors that name the file and line
(or skip and count), unique prompt ids, tokenizers."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from laminar.datasets import ByteTokenizer, DatasetError, load_records, load_tokenizer, tokenize_records


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_broken_row_names_file_and_line(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, "{not json", {"prompt": "c", "answer": "3"}])
    with pytest.raises(DatasetError, match=r"d\.jsonl: line 2: not valid JSON"):
        load_records(p)
    recs, skipped = load_records(p, on_bad_row="skip")
    assert [r.prompt for r in recs] == ["a", "c"] and skipped == 1


@pytest.mark.parametrize("row, why", [
    ({"question": "b", "answer": 2}, "field 'prompt' missing or not a string"),
    ({"prompt": 7, "answer": 2}, "field 'prompt' missing or not a string"),
    ({"prompt": "b"}, "field 'answer' missing or not a string/number"),
    ({"prompt": "b", "answer": [1]}, "field 'answer' missing or not a string/number"),
    ([1, 2], "expected an object, got list"),
])
def test_bad_row_names_file_line_and_reason(tmp_path, row, why):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, row])
    with pytest.raises(DatasetError, match=rf"d\.jsonl: line 2: {why}"):
        load_records(p)


def test_blank_lines_keep_line_numbers(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "answer": 1}\n\n{"prompt": 3}\n')
    with pytest.raises(DatasetError, match="line 3"):
        load_records(p)


def test_custom_fields_ids_and_duplicate_ids(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"q": "a", "sol": 1, "id": "x"}, {"q": "b", "sol": 2, "id": "y"}])
    recs, _ = load_records(p, prompt_field="q", answer_field="sol", id_field="id")
    assert [(r.prompt_id, r.prompt, r.answer) for r in recs] == [("x", "a", "1"), ("y", "b", "2")]
    write_jsonl(p, [{"q": "a", "sol": 1, "id": "x"}, {"q": "b", "sol": 2, "id": "x"}])
    with pytest.raises(DatasetError, match=r"line 2: prompt id 'x' repeats the one at .*d\.jsonl: line 1"):
        load_records(p, prompt_field="q", answer_field="sol", id_field="id")


def test_parquet_folder_and_chat_layout(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    rows = [{"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dapo.parquet")
    recs, _ = load_records(tmp_path, answer_field="reward_model.ground_truth")
    assert recs[0].prompt == "1+1?" and recs[0].answer == "2"


def test_parquet_bad_row_names_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": None, "answer": "2"}]),
                   tmp_path / "d.parquet")
    with pytest.raises(DatasetError, match=r"d\.parquet: row 1: field 'prompt'"):
        load_records(tmp_path / "d.parquet")


def test_folder_mixes_files_in_name_order(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": "b", "answer": 1}])
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a", "answer": 1}])
    (tmp_path / "notes.txt").write_text("ignored")
    assert [r.prompt for r in load_records(tmp_path)[0]] == ["a", "b"]


def test_missing_or_unknown_files(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        load_records(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match="unknown dataset format"):
        load_records(tmp_path / "d.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no .jsonl or .parquet files"):
        load_records(tmp_path / "empty")


def test_parquet_without_pyarrow_says_so(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DatasetError, match="needs pyarrow"):
        load_records(tmp_path / "d.parquet")


def test_byte_tokenizer_round_trip_and_tokenize_records(tmp_path):
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids[0] == tok.bos_id and all(3 <= i < tok.vocab_size for i in ids[1:])
    assert tok.decode(ids[1:] + [tok.eos_id, 50]) == "héllo"
    assert isinstance(load_tokenizer(str(tmp_path)), ByteTokenizer)  # no tokenizer files: bytes
    recs, _ = load_records(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "answer": 1}]))
    [p] = tokenize_records(recs, tok)
    assert p.prompt_tokens.dtype == np.int32 and p.prompt_tokens.tolist() == [1, ord("h") + 3, ord("i") + 3]
