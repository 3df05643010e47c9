"""The client side of a run: the streaming OpenAI client that times each request as a user
sees it (stream.py), the client protocol `replay` and `simulate` follow alike (protocol.py)
with its concurrency cap (concurrency.py, pure), and headless Chromium for the operator
page (chromium.py: Playwright driving the system's browser).

May import loadgen.traces (the rows a protocol filters) and the router's header names;
nothing else of the harness. This file imports nothing.
"""
