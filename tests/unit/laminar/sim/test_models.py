"""The simulator's models (laminar/sim): KV arithmetic on the worked example, step-curve
interpolation and the roofline bound B, length fits against the paper's statistics, the trainer
cost formula and the relay model. Statistics are checked on samples, with tolerances that say how
well a lognormal (mixture) can match four numbers."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from laminar.sim import load_workload
from laminar.sim.hardware import gpu, kv_capacity_tokens, model
from laminar.sim.latency import prefill_ms_per_token, transfer_curve
from laminar.sim.lengths import LengthDistribution, sample_groups, workload_lengths, z_from_key
from laminar.sim.trainer_cost import RelayLink, TrainerCost, broadcast_s, compare_with_paper
from laminar.stepcurve import StepCurve, roofline_batch_bound

# paper.json's response_length_tokens (copied so these tests do not depend on the workload file)
PAPER_LENGTHS = {
    "7B_math": {"mean": 5530, "p50": 6140, "p90": 9740, "p99": 14000, "note": "bimodal"},
    "32B_math": {"mean": 3330, "p50": 2830, "p90": 5990, "p99": 10480},
    "72B_math": {"mean": 1020, "p50": 920, "p90": 1720, "p99": 2790},
    "7B_tool": {"mean": 1040, "p50": 900, "p90": 1690, "p99": 3960},
    "AIME_base": {"mean": 2128, "p50": 1626, "p90": 4482, "p99": 7910},
}
BATCH = [1, 4, 8, 16, 32, 64, 128, 256, 512]
CURVE_32B_TP4 = [10.5, 11, 11.6, 12.6, 15, 18, 26, 37, None]
CURVE_7B_TP1 = [7, 7, 7.5, 8, 9.5, 12.5, 18, 29.5, None]


def workload_or_skip() -> dict:
    try:
        return load_workload()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


# -- hardware -------------------------------------------------------------------------------------
def test_kv_capacity_worked_example_72b_on_8_h800():
    m, g = model("Qwen2.5-72B"), gpu("H800")
    assert m.params == 72_706_203_648
    assert m.kv_bytes_per_token(tp=8) == 2 * 80 * 8 * 128 * 2 == 327_680
    by_hand = (80 * 2 ** 30 * 0.9 * 8 - 72_706_203_648 * 2) // 327_680
    assert kv_capacity_tokens(m, g, tp=8) == by_hand == 1_443_673


def test_parameter_counts_match_the_model_cards():
    for name, card in (("7B", 7.61e9), ("32B", 32.76e9), ("72B", 72.7e9)):
        assert model(name).params == pytest.approx(card, rel=0.005)


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    m = model("7B")  # 4 KV heads
    assert m.kv_bytes_per_token(tp=2) == 2 * 28 * 4 * 128 * 2
    assert m.kv_bytes_per_token(tp=8) == 2 * 28 * 8 * 128 * 2
    assert kv_capacity_tokens(m, gpu("H100"), 4) > kv_capacity_tokens(m, gpu("H100"), 1)


def test_kv_capacity_refuses_a_model_that_does_not_fit():
    with pytest.raises(ValueError, match="does not fit"):
        kv_capacity_tokens(model("72B"), gpu("H800"), tp=1)
    with pytest.raises(KeyError, match="known"):
        model("13B")


# -- step latency ---------------------------------------------------------------------------------
def test_curve_interpolates_clamps_and_extrapolates():
    c = StepCurve.from_points(zip(BATCH, CURVE_32B_TP4, strict=False))
    assert c.batches[-1] == 256  # the null point is skipped
    assert c.step_ms(1) == 10.5 and c.step_ms(0.5) == 10.5 and c.step_ms(0) == 0.0
    assert c.step_ms(48) == pytest.approx((15 + 18) / 2)
    assert c.step_ms(100) == pytest.approx(18 + (26 - 18) * (100 - 64) / 64)
    assert c.step_ms(512) == pytest.approx(37 + (37 - 26) / 128 * 256)  # the last segment, extended
    assert c.step_s(16) == pytest.approx(0.0126)


def test_roofline_batch_bound_is_the_knee():
    assert (
        roofline_batch_bound(StepCurve.from_points(zip(BATCH, CURVE_32B_TP4, strict=False))) == 16
    )  # 12.6 <= 1.2 × 10.5
    # 7B TP1: 1.2 × 7 = 8.4 falls between batch 16 (8 ms) and 32 (9.5 ms): 8 + 1.5 (b − 16)/16 <= 8.4
    assert roofline_batch_bound(StepCurve.from_points(zip(BATCH, CURVE_7B_TP1, strict=False))) == 20
    assert roofline_batch_bound(StepCurve.from_points(zip(BATCH, CURVE_7B_TP1, strict=False)), tolerance=1.0) == 4
    noisy = StepCurve.from_points([(1, 10), (8, 11), (16, 13), (32, 11.5)])  # a dip past the knee
    assert roofline_batch_bound(noisy) == 12  # 11 + 2 (b − 8)/8 <= 12; the dip at 32 is ignored


def test_curve_from_measured_formats(tmp_path):
    pairs = [[1, 5.0], [8, 6.0], [64, 12.0]]
    a = StepCurve.from_measured(pairs)
    b = StepCurve.from_measured({"batch": [1, 8, 64], "ms": [5.0, 6.0, 12.0]})
    c = StepCurve.from_measured({"64": 12.0, "1": 5.0, "8": 6.0})
    (tmp_path / "curve.json").write_text(json.dumps(pairs))
    d = StepCurve.load(tmp_path / "curve.json")
    assert a.ms == b.ms == c.ms == d.ms and a.batches == d.batches == (1, 8, 64)
    with pytest.raises(ValueError, match="increasing"):
        StepCurve((1, 1), (2.0, 3.0))


def test_paper_curves_load_and_72b_is_estimated():
    w = workload_or_skip()
    c = StepCurve.from_paper("32B", 4, w)
    assert c.step_ms(1) == 10.5 and roofline_batch_bound(c) == 16
    for key in w["decode_step_latency_ms_at_seq4096"]:
        if key != "batch":
            size, tp = key.split("_TP")
            assert 4 <= roofline_batch_bound(StepCurve.from_paper(size, int(tp), w)) <= 128
    with pytest.raises(KeyError, match="available"):
        StepCurve.from_paper("72B", 8, w)
    est = transfer_curve(StepCurve.from_paper("32B", 8, w), model("32B"), model("72B"))
    assert est.step_ms(1) == pytest.approx(8 * model("72B").params / model("32B").params)
    assert est.source.startswith("estimate")


def test_prefill_cost_per_token():
    m, g = model("32B"), gpu("H800")
    assert prefill_ms_per_token(m, g, 4) == pytest.approx(2 * m.params / (4 * 989e12 * 0.5) * 1000)
    assert 0.02 < prefill_ms_per_token("32B", g, 4) < 0.05  # ~68 ms for a 2048-token prompt


# -- response lengths -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PAPER_LENGTHS))
def test_length_fit_matches_the_paper_statistics(name):
    target = PAPER_LENGTHS[name]
    d = LengthDistribution.fit(target, cap=16384, name=name)
    s = d.sample(np.random.default_rng(1), 40_000)
    assert s.min() >= 1 and s.max() <= 16384
    assert np.median(s) == pytest.approx(target["p50"], rel=0.07)
    assert s.mean() == pytest.approx(target["mean"], rel=0.03)
    # a lognormal cannot match four numbers exactly: p90/p99 within 15% (7B_tool's p90 is the worst)
    assert np.percentile(s, 90) == pytest.approx(target["p90"], rel=0.15)
    assert np.percentile(s, 99) == pytest.approx(target["p99"], rel=0.15)
    assert s.mean() == pytest.approx(d.mean(), rel=0.02)  # the analytic mean agrees with sampling
    assert len(d.weights) == (2 if name == "7B_math" else 1)


def test_bimodal_fit_has_a_short_mode_under_a_long_one():
    d = LengthDistribution.fit(PAPER_LENGTHS["7B_math"], cap=16384)
    short, long_ = sorted(math.exp(m) for m in d.mus)
    assert 500 < short < 2000 and long_ > 5000 and 0.1 < min(d.weights) < 0.5
    s = d.sample(3, 20_000)
    assert s.mean() < np.median(s)  # the shape the paper reports: mean below median


def test_clipping_to_a_small_cap_keeps_the_analytic_mean():
    d = LengthDistribution.fit(PAPER_LENGTHS["32B_math"], cap=4096)
    s = d.sample(0, 40_000)
    assert s.max() == 4096 and (s == 4096).mean() > 0.1
    assert s.mean() == pytest.approx(d.mean(), rel=0.02)


def test_sampling_is_seeded_and_keys_give_standard_normals():
    d = LengthDistribution.fit(PAPER_LENGTHS["72B_math"], cap=16384)
    assert np.array_equal(d.sample(7, 100), d.sample(7, 100))
    z = np.array([z_from_key(k) for k in range(20_000)])
    assert abs(z.mean()) < 0.03 and z.std() == pytest.approx(1.0, abs=0.03)
    assert z_from_key(5, 0) == z_from_key(5, 0) != z_from_key(5, 1)


def test_groups_are_iid_by_default_and_correlated_on_request():
    d = LengthDistribution.fit(PAPER_LENGTHS["72B_math"], cap=16384)
    for rho in (0.0, 0.6):
        g = sample_groups(d, np.random.default_rng(0), 4000, 16, rho=rho)
        logs = np.log(g)
        within = np.corrcoef(logs[:, 0], logs[:, 1])[0, 1]
        assert within == pytest.approx(rho, abs=0.05)
        assert np.median(g) == pytest.approx(920, rel=0.05)  # the marginal is unchanged


def test_workload_lengths_read_the_file():
    w = workload_or_skip()
    d = workload_lengths("32B_math", w)
    assert d.cap == w["run_shape"]["max_output_tokens"]
    assert d.summary()["p50"] == pytest.approx(2830, rel=0.03)


# -- trainer cost and relay -------------------------------------------------------------------------
def test_iteration_time_formula():
    c = TrainerCost.build("7B", "H800", 8, mfu=0.4, recompute=False)
    tokens = 8192 * 3000
    expected = 6 * model("7B").params * tokens / (8 * 989e12 * 0.4)
    assert c.iteration_s(tokens) == pytest.approx(expected)
    with_recompute = TrainerCost.build("7B", "H800", 8, mfu=0.4, recompute=True)
    assert with_recompute.iteration_s(tokens) == pytest.approx(expected * 4 / 3)
    with_ref = TrainerCost.build("7B", "H800", 8, mfu=0.4, recompute=False, extra_forward_passes=1)
    assert with_ref.iteration_s(tokens) == pytest.approx(expected * 8 / 6)
    assert TrainerCost.build("7B", "H800", 16, mfu=0.4, recompute=False).iteration_s(tokens) == pytest.approx(
        expected / 2
    )


def test_relay_model_is_nearly_flat_in_machines():
    link = RelayLink(bandwidth_gbps=100.0, chunk_mib=32.0, alpha_s=0.002)
    size = 10e9
    per_hop = 32 * 2 ** 20 / 100e9 + 0.002
    assert broadcast_s(size, 2, link) == pytest.approx(0.1)
    assert broadcast_s(size, 1, link) == pytest.approx(0.1)
    assert broadcast_s(size, 66, link) == pytest.approx(0.1 + 64 * per_hop)
    c = TrainerCost.build("72B", "H800", 768)
    assert c.publish_stall_s() == pytest.approx(model("72B").weight_bytes() / 200e9)
    assert c.broadcast_s(128) < 1.5 * c.broadcast_s(4)


def test_relay_comparison_rows_cover_the_paper_figures():
    w = workload_or_skip()
    rows = compare_with_paper(w)
    assert len(rows) == 2 * (len(w["relay_broadcast_latency_s_by_machines"]["machines"]) + 1)
    assert all(r["model_s"] > 0 and r["paper_s"] > 0 for r in rows)
