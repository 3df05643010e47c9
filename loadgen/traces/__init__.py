"""Traces: the rows every runner reads (`TraceRequest`), the file readers and writer, the
generated workloads (synthetic sessions, the paper-shaped window), windows and time
scaling, the statistics that describe a workload, and prompt synthesis (block ids into
text of exact token counts).

The bottom room of the load generator: imports nothing of the harness (the router's
tokenizer only, for ART-Chat bodies). Within it, request.py is the leaf; load.py, which
tells the sources apart, sits on top. This file imports nothing.
"""
