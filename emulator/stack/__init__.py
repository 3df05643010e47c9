"""The local stack (`gorgo up`): Envoy -> gorgo serve, plus per region an emulated engine
behind a WAN delay link, all as child processes, no Docker. Used by the CLI, `make demo`,
the end-to-end tests and the benchmarks, so they all exercise the same wiring.

    settings.py     regions, port layout, StackSettings and the router config they make
    fleet.py        fleet files: each region's engine profile, model and LoRA adapters
    ports.py        free ports, each handed out once per process
    processes.py    the children's command lines; spawning, logging and stopping them
    supervisor.py   when to restart a child that died (the policy, no processes)
    supervision.py  readiness waits; restarting children that die (warm spares)
    spare.py        a warm spare: a Python child's modules imported ahead, waiting to become it
    front_door.py   more front doors (an Envoy and a router per region)
    pd.py           `gorgo up --pd`'s layout: P/D twins per region, KV links per pair
    pd_twins.py     the P/D twins' and KV links' command lines; starting them
    stack.py        Stack, which wires the above, and `gorgo up`'s main loop
    up_cli.py       `gorgo up`'s flags and how they become StackSettings

May import the engine room (emulator.engine: LoRA names, the tiny tokenizer, the P/D
twins' KV scale), the WAN link (emulator.wan), emulator.vllm (real engines) and the
router's config and Envoy rendering; never the load generator. This file imports
nothing: import each name from its module (`from emulator.stack.stack import Stack`).
"""
