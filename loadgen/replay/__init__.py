"""`gorgo replay`: a trace live against an OpenAI endpoint, open loop. run.py is the
command (options, run, outputs), loop.py its asyncio shell, requests.py the pure core (a
trace row into a request, the answer into a result row), plots.py its figures, commands.py
its parser.

May import loadgen.traces, loadgen.client and loadgen.results. This file imports nothing.
"""
