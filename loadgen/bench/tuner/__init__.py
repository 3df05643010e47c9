"""The tuner bench (`gorgo bench tuner`) in the simulator: the grid, convergence, resolution
and false accepts (study.py), the regime change (regime.py), the three targets
(targets.py) and the report that renders them (report.py); the P/D knobs' study
(knobs.py, `--pd-knobs`).

May import loadgen.sim, loadgen.traces, loadgen.client, loadgen.results and the WAN delay
settings. This file imports nothing.
"""
