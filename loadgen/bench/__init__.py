"""`gorgo bench ...`: the benchmarks, a room for each kind, each room's commands.py
registering its benches' parsers:

    sim/      in the simulator: the target matrix and its floors, fleets, models, learn,
              the paper's experiment under its protocol
    tuner/    the tuner in the simulator: grid, convergence, regime change, its targets
    live/     through a live local stack: overhead, load, routers, path, page, engine,
              parity with the simulator, prefix state, a fleet learned live, the screenshot
    router/   the router core in one process: decide, KV bursts, the KV index
    peers/    gorgo against SMG and vllm-router live on one fleet (`gorgo bench peers`,
              its parser in live/commands.py), aggregated and P/D
    results.py  `gorgo bench results` (`make bench`): docs/results.md from all of the above

A bench room may import the rooms below the benches (traces, client, replay, sim,
results) and the emulator; live/ also router/'s measurements and peers/ (the `peers`
parser's runner); only results.py imports across the other bench rooms. This file imports nothing.
"""
