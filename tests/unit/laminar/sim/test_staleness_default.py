"""The laminar modes keep the paper's staleness bound by default (paper.yaml `staleness`): the
contract command `bench/scale.py --model 72B --gpus 1024` reported max staleness 12 with no bound
(the rollouts out-produce a training-bound trainer and the backlog ages; a long group finishes
eight iterations late). Now its laminar runs carry the prompt pool's max_batches_ahead 3 and the
experience buffer's max_staleness 4 — the real roles' settings — and `laminar_unbounded`, run
beside it on request, measures what the bound costs; the barrier modes keep their own gates."""
from __future__ import annotations

import pytest
import yaml

from bench.scale import main, parser
from bench.sim.results import assemble
from laminar.sim.scenario import staleness_bound
from laminar.sim.setup import DEFAULT_MODES, load_setup
from tests.support import ROOT
from tests.unit.bench.sim.test_sweep_validity import run


def test_the_cluster_files_of_the_contract_scale_bound_staleness_by_default(tmp_path):
    assert main(["--write-configs", str(tmp_path), "--model", "72B", "--gpus", "1024",
                 "--modes", "laminar,laminar_norepack,laminar_unbounded,sync"]) == 0
    cfg = {m: yaml.safe_load((tmp_path / f"72B-1024-{m}.yaml").read_text())
           for m in ("laminar", "laminar_norepack", "laminar_unbounded", "sync")}
    for m in ("laminar", "laminar_norepack"):
        assert cfg[m]["roles"]["experience_buffer"]["max_staleness"] == 4
        assert cfg[m]["roles"]["prompt_pool"]["max_batches_ahead"] == 3
    free = cfg["laminar_unbounded"]
    assert free["run"]["mode"] == "laminar"  # a real mode: laminar, without the bound
    assert "max_staleness" not in free["roles"]["experience_buffer"]
    assert "max_batches_ahead" not in free["roles"]["prompt_pool"]
    assert "max_staleness" not in cfg["sync"]["roles"]["experience_buffer"]  # its own bound comes from the mode


def test_the_command_line_sets_or_lifts_the_bound():
    setup = load_setup(ROOT / "configs" / "sim" / "paper.yaml")
    a = parser().parse_args([])
    assert a.modes.split(",") == list(DEFAULT_MODES)  # laminar_unbounded only when asked for
    assert staleness_bound(setup, "laminar", a.ahead, a.max_staleness) == (3, 4)
    a = parser().parse_args(["--ahead", "none", "--max-staleness", "6"])
    assert staleness_bound(setup, "laminar", a.ahead, a.max_staleness) == (None, 6)
    assert staleness_bound(setup, "one_step", 2, 2) == (None, None)
    with pytest.raises(SystemExit):
        parser().parse_args(["--ahead", "some"])


def test_the_reported_staleness_is_the_bounded_runs_and_the_cost_is_their_ratio():
    lam, free = run(950.0), run(1000.0)
    lam["max_staleness"], free["max_staleness"] = 4, 12
    lam["dropped_stale_groups"] = 3
    obj = assemble("72B", 1024, {"laminar": lam, "laminar_unbounded": free}, {"laminar": 5, "laminar_unbounded": 5},
                   {"laminar": 8, "laminar_unbounded": 8})
    assert obj["max_staleness"] == 4 and obj["max_staleness_by_mode"]["laminar_unbounded"] == 12
    assert obj["staleness_bound_cost"] == pytest.approx(0.95)
    assert obj["dropped_stale_groups"]["laminar"] == 3
