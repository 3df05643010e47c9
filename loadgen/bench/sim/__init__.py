"""Benches in the simulator: the target matrix (target.py, its report target_report.py, its
floors floors.py), the paper's experiment under its protocol (paper.py), the learned speed
on a uniform fleet (learn.py) and on heterogeneous ones (fleets.py), many models
(models.py); the policies they compare (policies.py).

May import loadgen.sim, loadgen.traces, loadgen.client, loadgen.results and the
emulator's fleet files. This file imports nothing.
"""
