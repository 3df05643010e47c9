"""`gorgo simulate`: a trace offline on a virtual clock, through the very router and engine
model of the live fleet. simulate.py is the simulator, models.py what each simulated
engine serves, run.py the command (runs, summary, result files), figures.py its
figures, commands.py its parser.

May import loadgen.traces, loadgen.client (the protocol and its cap), loadgen.results, the
emulator's engine model, fleet files and WAN delay model, and the router. Nothing of
loadgen.bench or loadgen.replay. This file imports nothing.
"""
