"""Benches through a live local stack (`gorgo up`'s): what the router adds (overhead.py,
path.py), load and several routers (load.py, routers.py), the operator page (page.py,
screenshot.py), one engine (engine.py), the simulator against live (parity.py), precise
against approximate prefix state (prefix_state.py), a heterogeneous fleet learned live
(fleet.py).

May import emulator.stack, loadgen.replay, loadgen.client, loadgen.traces,
loadgen.results, loadgen.sim (parity) and loadgen.bench.router (the page reuses decide's
router). This file imports nothing.
"""
