"""The laminar modes' measured window: `measure` rounded down to whole waves of updates, at
least one wave, on the waves paper.yaml's placements give."""
from __future__ import annotations

from pathlib import Path

from laminar.sim import load_workload
from laminar.sim.scenario import measured_versions, wave_versions
from laminar.sim.setup import load_setup

ROOT = Path(__file__).resolve().parents[4]


def test_rounded_down_to_whole_waves_at_least_one():
    assert [measured_versions(5, w) for w in (1, 2, 3, 4, 5, 6, 8)] == [5, 4, 3, 4, 5, 6, 8]
    assert measured_versions(12, 4) == 12 and measured_versions(3, 2) == 2


def test_the_contract_scale_measures_one_wave():
    setup = load_setup(ROOT / "configs" / "sim" / "paper.yaml")
    workload = load_workload(setup.workload)
    wave = wave_versions(setup, workload, "72B", 1024)
    n = measured_versions(setup.iterations.measure, wave)
    assert n == wave == 4  # one whole wave: the first of two came within 0.2-1.6% of both (docs/sim.md)
    assert n % wave == 0
