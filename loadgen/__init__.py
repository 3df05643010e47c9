"""The load generator (harness): traces, the streaming client, live replay, the offline
simulator and the benchmarks, each in a room of its own, and the `gorgo` subcommands they
add (`demo`, `replay`, `simulate`, `bench ...`: cli.py collects each room's commands.py).

    traces/       trace files, generated workloads, their statistics, prompt synthesis
    client/       the streaming OpenAI client, the client protocol and its concurrency cap
    replay/       `gorgo replay`: a trace live against an endpoint, open loop
    sim/          `gorgo simulate`: a trace through the router and the engine model offline
    bench/        `gorgo bench ...`, by kind: sim/, tuner/, live/, router/, and results.py
    results.py    the result-file schema `replay` and `simulate` share (imports nothing here)
    progress.py   progress bars of the long runs, on a terminal only (imports nothing here)
    demo.py       `make demo`
    data/         a slice of the conversation trace and the fleet files (no code)

Rooms import downwards only: traces <- client <- replay, sim <- bench, and cli.py above
all; any of them may import the router (ext_proc) and the emulator, never the other way
round. This file imports nothing.
"""
