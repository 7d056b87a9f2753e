"""The multi-host ledger's reward side (laminar/testing/ledger_rewards.py): with a model term in the
rollouts' reward, a trained member stored without that score counts in `trained_unscored`; one the
partial pool stored with its score does not. Trajectories the pool stored (its own
`trajectory_stored` lines) or still holds awaiting a score are neither lost nor unaccounted for.

The run folder is written by hand, as a stopped cluster leaves it (the ledger only reads files)."""
from __future__ import annotations

import json
import sqlite3

import yaml

from laminar.testing.multihost import MultiHost

RULE = "fn:laminar.tasks.rewards:upper_fraction"
AT = "2026-11-27T13:42:58Z"


def stored(role: str, tid: str, components: dict | None = None) -> str:
    e = {"role": role, "event": "trajectory_stored", "trajectory": tid, "version": 3, "lineage": 1,
         "status": "stored", "timestamp": AT}
    if components is not None:
        e["components"] = components
    return json.dumps(e) + "\n"


def run_folder(tmp_path, rewards: list[dict]) -> MultiHost:
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump({"roles": {"rollout": {"rewards": rewards}}}))
    run = tmp_path / "run"
    for d in ("logs", "trainer", "pools"):
        (run / d).mkdir(parents=True)
    logs = run / "logs"
    # g1: scored by the model in the pool, then stored by it
    (logs / "partial_pool.0.log").write_text("".join(
        [stored("partial_pool", f"g1/{i}", {RULE: 0.5, "rm": 0.4}) for i in range(2)]
        # g3/0: stored by the pool although its components lack the model's score
        + [stored("partial_pool", "g3/0", {RULE: 0.5})]))
    # g2: put straight into the buffer by a rollout (no model score at all)
    (logs / "rollout.1a.log").write_text("".join(stored("rollout", f"g2/{i}") for i in range(2)))
    (logs / "manager.0.log").write_text(json.dumps({"role": "manager", "event": "recovering", "timestamp": AT,
                                                    "ids": ["g1/0", "g4/0"]}) + "\n")
    (run / "trainer" / "metrics.jsonl").write_text("".join(
        json.dumps({"version": v, "ts": 1795787100.0 + v, "samples": 2.0, "group_ids": gs}) + "\n"
        for v, gs in ((1, ["g1"]), (2, ["g2", "g3"]))))
    with sqlite3.connect(run / "pools" / "partial_pool-0.sqlite") as con:
        con.executescript("CREATE TABLE deltas (tid TEXT); CREATE TABLE completed (tid TEXT); "
                          "CREATE TABLE chunks (blob BLOB); CREATE TABLE awaiting (tid TEXT, blob BLOB, "
                          "pending TEXT, scores TEXT); INSERT INTO awaiting VALUES ('g4/0', NULL, '{}', '{}');")
    return MultiHost.reading(run)


def test_reward_role_ledger_counts_trained_members_stored_without_their_model_score(tmp_path):
    led = run_folder(tmp_path, [{"fn": RULE[3:], "weight": 0.9}, {"role": "rm", "weight": 0.1}]).ledger()
    assert led["trained_unscored"] == 3          # g2/0, g2/1 (a rollout's own put) and g3/0 (no rm)
    assert led["trained_with_fallback"] == 0
    # g1/0 was recovered and stored by the pool; g4/0 still awaits its score there: neither is lost
    assert led["trajectories_lost"] == 0 and led["recovered_finished"] == 1 and led["recovered_pending"] == 1


def test_reward_role_ledger_without_a_model_term_counts_nothing_unscored(tmp_path):
    led = run_folder(tmp_path, [{"fn": RULE[3:], "weight": 1.0}]).ledger()
    assert led["trained_unscored"] == 0


def test_reward_role_ledger_counts_a_fallback_score_apart(tmp_path):
    mh = run_folder(tmp_path, [{"fn": RULE[3:], "weight": 0.9}, {"role": "rm", "weight": 0.1}])
    with open(mh.run_dir / "logs" / "partial_pool.0.log", "a") as f:
        f.write(stored("partial_pool", "g2/0", {RULE: 0.5, "rm": 0.0, "gave_up:rm": 1.0}))
    led = mh.ledger()
    assert led["trained_with_fallback"] == 0 and led["trained_unscored"] == 3  # g2/0's other copy lacked it
    (mh.run_dir / "logs" / "rollout.1a.log").write_text("")
    led = mh.ledger()
    assert led["trained_with_fallback"] == 1 and led["trained_unscored"] == 1  # g3/0
