"""The headroom figure reads its numbers from the eval documents and the evaluator's records."""
import json

import pytest

from laminar.tasks.headroom_plot import change_points, curve_points, draw, level_points, main


def _doc(values):
    return {"sets": {name: {"problems": 512, "metrics": {"greedy": {"value": v, "lo": v - 0.04, "hi": v + 0.04}}}
                     for name, v in values.items()}}


def test_level_points_are_the_level_sets_in_order():
    doc = _doc({"d3": 0.4, "d2": 0.6, "heldout": 0.5})
    doc["sets"]["d4"] = {"problems": 128, "metrics": {"avg@8": {"value": 0.1, "lo": 0.0, "hi": 0.2}}}
    assert level_points(doc) == [(2, 0.6, pytest.approx(0.56), pytest.approx(0.64)),
                                 (3, 0.4, pytest.approx(0.36), pytest.approx(0.44))]
    assert level_points(doc, "avg@8") == [(4, 0.1, 0.0, 0.2)]


def test_change_points_are_the_compared_differences():
    doc = {"after_minus_before": {"d5": {"greedy": {"diff": -0.02, "lo": -0.05, "hi": 0.01}},
                                  "d2": {"greedy": {"diff": 0.03, "lo": 0.01, "hi": 0.05}},
                                  "d2s": {"avg@8": {"diff": 0.1, "lo": 0.0, "hi": 0.2}}}}
    assert change_points(doc) == [(2, 0.03, 0.01, 0.05), (5, -0.02, -0.05, 0.01)]


def test_curve_points_keep_the_last_record_of_a_version(tmp_path):
    ev = tmp_path / "evaluator"
    ev.mkdir()
    k = "eval/heldout/greedy"
    recs = [{"version": 0.0, k: 0.29, f"{k}/lo": 0.2, f"{k}/hi": 0.37},
            {"version": 10.0, k: 0.30, f"{k}/lo": 0.2, f"{k}/hi": 0.38},
            {"version": 10.0, k: 0.31, f"{k}/lo": 0.2, f"{k}/hi": 0.39},
            {"version": 5.0, "eval/beyond/greedy": 0.01}]
    (ev / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    assert curve_points(tmp_path) == [(0, 0.29, 0.2, 0.37), (10, 0.31, 0.2, 0.39)]


def test_the_figure_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    before.write_text(json.dumps(_doc({"d2": 0.6, "d3": 0.4})))
    doc = _doc({"d2": 0.62, "d3": 0.41})
    doc["after_minus_before"] = {"d2": {"greedy": {"diff": 0.02, "lo": -0.01, "hi": 0.05}}}
    after.write_text(json.dumps(doc))
    out = draw(tmp_path / "fig" / "h.png", before, [("run", after)], [])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_label_without_a_path_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="LABEL=PATH"):
        main([str(tmp_path / "x.png"), "--before", str(tmp_path / "b.json"), "--after", "nolabel"])
