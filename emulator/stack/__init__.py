"""The local stack (`gorgo up`): Envoy -> gorgo serve, plus per region an emulated engine
behind a WAN delay link, all as child processes, no Docker. Used by the CLI, `make demo`,
the end-to-end tests and the benchmarks, so they all exercise the same wiring.

    settings.py     regions, port layout, StackSettings and the router config they make
    ports.py        free ports, each handed out once per process
    processes.py    the children's command lines; spawning, logging and stopping them
    supervision.py  readiness waits; restarting children that die (warm spares)
    front_door.py   more front doors (an Envoy and a router per region)
    stack.py        Stack, which wires the above, and `gorgo up`'s main loop

This package's names are the stack's public entry; the rest is imported from its module.
"""

from emulator.stack.processes import StackError
from emulator.stack.settings import DEFAULT_REGIONS, Region, StackPorts, StackSettings
from emulator.stack.stack import Stack

__all__ = ["DEFAULT_REGIONS", "Region", "Stack", "StackError", "StackPorts", "StackSettings"]
