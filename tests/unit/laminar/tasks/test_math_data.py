"""Math prompt sets: the arithmetic generator is deterministic and its answers verify; DAPO-Math-17k
rows (JSONL and Parquet) convert to the prompt pool's layout, repeats dropped, bad rows named."""
from __future__ import annotations

import json
from fractions import Fraction

import pytest

from laminar.datasets import DatasetError, load_records
from laminar.tasks.math import is_equivalent
from laminar.tasks.math_data import arithmetic_records, load_dapo, main

pytest.importorskip("math_verify")


def dapo_row(i: int, answer="34", index=None) -> dict:
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": f'Solve problem {i}.\n\nRemember to put your answer after "Answer:".'}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lm"},
        "extra_info": {"index": index or f"uuid-{i}"},
    }


def test_arithmetic_set_is_deterministic_and_verifiable(tmp_path):
    a, b = arithmetic_records(60, seed=3), arithmetic_records(60, seed=3)
    assert a == b and a != arithmetic_records(60, seed=4)
    assert len({r["id"] for r in a}) == 60
    for r in a:
        assert r["prompt"].endswith("Put the final answer in \\boxed{}.")
        value = Fraction(r["answer"])  # reduced fraction or integer
        assert is_equivalent(r["answer"], r["answer"])
        assert is_equivalent(f"{float(value):.6g}" if value.denominator in (1, 2, 4, 5, 8, 10, 20, 25, 50) else
                             f"\\frac{{{value.numerator}}}{{{value.denominator}}}", r["answer"]), r
    out = tmp_path / "arith.jsonl"
    main([str(out), "--n", "20", "--seed", "1"])
    recs, skipped = load_records(out, id_field="id")
    assert len(recs) == 20 and skipped == 0 and recs[0].answer == arithmetic_records(1, 1)[0]["answer"]


def test_dapo_jsonl_and_parquet(tmp_path):
    rows = [dapo_row(0), dapo_row(1, answer=7), dapo_row(0), dapo_row(2, "\\frac{1}{2}")]
    src = tmp_path / "dapo.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recs, counts = load_dapo(src)
    assert counts == {"rows": 4, "repeats": 1, "skipped": 0}
    assert [r["id"] for r in recs] == ["uuid-0", "uuid-1", "uuid-2"]
    assert recs[1]["answer"] == "7" and recs[0]["prompt"].startswith("Solve problem 0.")
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    same_types = [{**r, "reward_model": {**r["reward_model"], "ground_truth": str(r["reward_model"]["ground_truth"])}}
                  for r in rows]  # a Parquet column has one type
    pq.write_table(pa.Table.from_pylist(same_types), tmp_path / "dapo.parquet")
    recs2, _ = load_dapo(tmp_path / "dapo.parquet")
    assert recs2 == recs
    out = tmp_path / "converted.jsonl"
    main([str(out), "--from-dapo", str(tmp_path / "dapo.parquet")])
    pool, _ = load_records(out, id_field="id")  # what the prompt pool reads
    assert [(r.prompt_id, r.answer) for r in pool] == [("uuid-0", "34"), ("uuid-1", "7"), ("uuid-2", "\\frac{1}{2}")]
    # the raw DAPO file is also readable by the pool directly, with dotted field names
    direct, _ = load_records(src, answer_field="reward_model.ground_truth", id_field="extra_info.index",
                             on_bad_row="skip")
    assert [r.prompt_id for r in direct] == ["uuid-0", "uuid-1", "uuid-2"]


def test_dapo_bad_rows_are_named_or_skipped(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps(dapo_row(0)) + "\n" + "{not json\n" +
                   json.dumps({"prompt": [{"role": "user", "content": "q"}]}) + "\n" + json.dumps(dapo_row(1)) + "\n")
    with pytest.raises(DatasetError, match="line 2"):
        load_dapo(src)
    recs, counts = load_dapo(src, on_bad_row="skip")
    assert len(recs) == 2 and counts["skipped"] == 2
    with pytest.raises(DatasetError, match="not found"):
        load_dapo(tmp_path / "missing.parquet")
