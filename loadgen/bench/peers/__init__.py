"""`gorgo bench peers`: gorgo against the routers users deploy instead (SMG, vllm-router),
live on the same emulated fleet: the runs and their report (run.py), the P/D fleets'
legs and ratios (pd.py), request classes as each front reads them (classes.py).

May import emulator.stack, emulator.rivals, emulator.wan, loadgen.replay, loadgen.traces,
loadgen.results and loadgen.sim (the classes). This file imports nothing.
"""
