"""Benches of the router core in one process, no stack: a decision's latency and the index's
memory (decide.py), decisions under a burst of KV events over a real socket (kv_burst.py),
the per-engine block index at page size 1 (kv_index.py).

May import loadgen.client, the emulator's engine pieces (its tokenizer, its KV publisher)
and the tiny model's corpus (emulator.vllm); nothing else of the harness. This file imports nothing.
"""
