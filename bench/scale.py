"""Throughput by mode at the paper's scale, simulated; the simulator's component checks; the
expanded cluster files. The program lives in laminar/sim/harness.py (docs/sim.md):

    python bench/scale.py --model 72B --gpus 1024 --out runs/bench/scale-72B-1024.json
    python bench/scale.py --quick --out runs/bench/scale-quick.json
    python bench/scale.py --components --out runs/bench/components.json
    python bench/scale.py --write-configs DIR --model 72B --gpus 1024
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from laminar.sim.harness import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
