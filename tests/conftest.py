"""The test session's setup shared by every tier: with several workers (pytest-xdist,
`make test`), each worker and the processes it starts draw the local stacks' ports from a
slice of their own (emulator/stack/ports.py), so two workers' stacks never share a port."""

from __future__ import annotations

import os

from emulator.stack.ports import PORT_SLICE_ENV

_worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ... under xdist
_workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
if _worker.startswith("gw") and _workers.isdigit():
    os.environ[PORT_SLICE_ENV] = f"{int(_worker[2:])}/{_workers}"
