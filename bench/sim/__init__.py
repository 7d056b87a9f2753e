"""The simulator's sweep program (`bench/scale.py`): runs, processes, results, tables, component
checks. The models it drives live in `laminar/sim` (a library that imports no role or test code);
this program wires them to the real roles (bench/sim/cluster.py) and measures them."""
