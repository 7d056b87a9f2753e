"""Routing replay in the trainer (roles/trainer/routing_replay.py) on the tiny Qwen3-MoE model:

- replaying the model's own routing changes no logprob (the replay path computes what the
  router computes), and the version reports no disagreement;
- replaying other experts changes the logprobs (the recorded experts are the ones used) while
  replay off ignores them and only reports the disagreement;
- under replay the router still learns: its weights move with the policy loss (the gate weights of
  the replayed experts come from the trainer's softmax);
- the load-balancing loss follows `router_aux_loss_coef` (the model's by default, 0 = off), and a
  dense policy with routing_replay on is refused naming the setting;
- packed and padded micro-batches replay the same routing;
- the end-of-run summary of such a run lists every version's reward, staleness, mismatch and
  routing bytes per trajectory (laminar/summary_moe.py).
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from laminar.roles.trainer.config import TrainerConfig  # noqa: E402
from laminar.roles.trainer.engine import TrainEngine  # noqa: E402
from laminar.roles.trainer.routing_replay import find_routers  # noqa: E402

from laminar.models.loading import load_causal_lm  # noqa: E402
from laminar.models.tiny import build_tiny_model, build_tiny_moe_model  # noqa: E402
from laminar.testing.moe import with_routing  # noqa: E402
from laminar.testing.trainer_task import generate_groups  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_moe_model(tmp_path_factory.mktemp("moe") / "m", seed=0, init_std=0.2)


@pytest.fixture(scope="module")
def groups(moe_dir):
    torch.manual_seed(0)
    model = load_causal_lm(moe_dir, "cpu", train=False)
    return with_routing(model, generate_groups(model, 3, 4, version=0, max_new_tokens=6))


def engine(moe_dir, **kw):
    moe = kw.pop("moe", {})
    e = TrainEngine(TrainerConfig(model_dir=str(moe_dir), optimizer={"lr": 1e-2},
                                  logging={"mismatch_previous_version": False}, moe=moe, **kw),
                    0, torch.device("cpu"))
    e.load()
    return e


def shift_experts(rows):
    return ((rows.astype(np.int64) + 3) % 8).astype(rows.dtype)


def test_routing_replay_of_the_models_own_routing_changes_nothing(moe_dir, groups):
    for replay in (False, True):
        out = engine(moe_dir, moe={"routing_replay": replay}).train(groups, 1)
        assert out["mismatch_mean_abs"] < 1e-5, (replay, out["mismatch_mean_abs"])
        assert out["routing_disagree_token_share"] < 0.01
        trained = [t for g in groups if len({x.reward for x in g}) > 1 for t in g]  # uniform groups are left out
        assert out["routing_trajectories"] == len(trained)
        assert out["routing_bytes_per_trajectory"] == pytest.approx(np.mean([t.routing.nbytes for t in trained]))
        key = "routing_unreplayed_share" if replay else "routing_unrecorded_share"
        assert 0 < out[key] < 0.2  # each sequence's last token has no row


def test_routing_replay_uses_the_recorded_experts_and_the_router_still_learns(moe_dir, groups):
    moved = [[t.__class__(**{**t.__dict__, "routing": shift_experts(t.routing)}) for t in g] for g in groups]
    off = engine(moe_dir).train(moved, 1)
    assert off["mismatch_mean_abs"] < 1e-5                 # not replayed: the trainer's own experts
    assert off["routing_disagree_layer_share"] > 0.9       # ... which it reports differ from the recorded
    e = engine(moe_dir, moe={"routing_replay": True})
    gates = [r.weight.detach().clone() for _, r in find_routers(e.models.model)]
    on = e.train(moved, 1)
    assert on["mismatch_mean_abs"] > 0.05                  # replayed: other experts, other logprobs
    after = [r.weight.detach() for _, r in find_routers(e.models.model)]
    assert all(float((a - b).abs().max()) > 0 for a, b in zip(gates, after, strict=True))


def test_moe_aux_loss_follows_router_aux_loss_coef(moe_dir, groups, tmp_path):
    default = engine(moe_dir, moe={"routing_replay": True}).train(groups, 1)
    assert default["moe_aux_loss"] > 0                     # the model's own 0.001
    off = engine(moe_dir, moe={"routing_replay": True, "router_aux_loss_coef": 0.0}).train(groups, 1)
    assert "moe_aux_loss" not in off
    dense = build_tiny_model(tmp_path / "dense")
    with pytest.raises(ValueError, match="routing_replay"):
        engine(dense, moe={"routing_replay": True})


def test_routing_replay_packed_and_padded_agree(moe_dir, groups):
    moved = [[t.__class__(**{**t.__dict__, "routing": shift_experts(t.routing)}) for t in g] for g in groups]
    padded = engine(moe_dir, moe={"routing_replay": True}, performance={"packing": False}).train(moved, 1)
    packed = engine(moe_dir, moe={"routing_replay": True}, performance={"packing": True}).train(moved, 1)
    assert packed["mismatch_mean_abs"] == pytest.approx(padded["mismatch_mean_abs"], rel=1e-4)
    assert packed["routing_disagree_token_share"] == pytest.approx(padded["routing_disagree_token_share"])


def test_routing_replay_run_summary_reports_each_version(moe_dir, groups, tmp_path, capsys):
    """The end-of-run summary of a run with routing: per version its reward, staleness, mismatch,
    top-k disagreement and routing bytes per trajectory, as the trainer recorded them."""
    import time

    from laminar.roles.trainer.metrics import MetricsLog, batch_stats

    from laminar.summary import main as summary_main
    e, log = engine(moe_dir, moe={"routing_replay": True}), MetricsLog(tmp_path / "run" / "trainer")
    recorded = []
    for v in (1, 2):  # version 2 trains samples of version 0: one version stale, no mismatch measured
        rec = {**batch_stats(groups, v - 1), **e.train(groups, v), "version": float(v), "ts": time.time()}
        log.append(rec)
        recorded.append(rec)
    assert summary_main([str(tmp_path / "run")]) == 0
    s = __import__("json").loads((tmp_path / "run" / "summary.json").read_text())["moe"]
    rows = s["per_version"]
    assert [r["version"] for r in rows] == [1, 2]
    for row, rec in zip(rows, recorded, strict=True):
        assert row["reward"] == rec["reward_mean"] and row["staleness_max"] == rec["staleness_max"]
        assert row["routing_bytes_per_trajectory"] == rec["routing_bytes_per_trajectory"] > 0
        assert row["mismatch_mean_abs"] == rec.get("mismatch_mean_abs")
    assert rows[0]["mismatch_mean_abs"] is not None and rows[1]["staleness_max"] == 1
    assert s["mismatch_versions"] == sum(r["mismatch_mean_abs"] is not None for r in rows)
    out = capsys.readouterr().out
    assert "mixture of experts, per version:" in out
    assert f"{rows[0]['routing_bytes_per_trajectory']:.4g}" in out
