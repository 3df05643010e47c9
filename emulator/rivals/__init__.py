"""The rival routers users deploy instead of gorgo (SMG 1.13, vllm-router 0.1.17), run beside
it on the emulated fleet for `gorgo bench peers` and tests/peers.

Nothing here is imported by the router. The modules:

- :mod:`emulator.rivals.install`: makes the rivals' virtual environment ``.venv-peers``
  (stdlib only; runs with the system ``python3``; ``make peers``).
- :mod:`emulator.rivals.fronts`: each rival configuration (tool, policy, flags and why, the
  session header) and its command line.
- :mod:`emulator.rivals.process`: starts one rival, waits until it routes to every worker,
  stops it by PID; reads what its log and metrics say about the engines' loads.
"""
