"""Prefill/decode disaggregation in the engine twin: the two engines' P/D protocols, with
the KV moving between two twins over whatever link joins them (docs/engine-model.md,
"Prefill/decode disaggregation").

    config.py    what a P/D twin is configured with: SGLang's and vLLM's flags and
                 environment variables, each with the engine's file
    kv.py        KV bytes per transfer and the byte scaling that keeps loopback cheap
    prebuilt.py  the engine model with KV preallocated for a transfer and a request that
                 starts decoding on transferred KV; the P/D counters
    held.py      the prefill side's KV held for a decode (by bootstrap room or request id)
    respond.py   answers of P/D requests (streams, bodies, the engines' errors)
    sides.py     the side servers: SGLang's bootstrap server, vLLM's NIXL side channel
    sglang.py    SGLang's protocol: the prefill and decode request paths, the heartbeat
    nixl.py      vLLM's NixlConnector protocol: kv_transfer_params, the decode's pull
    twin.py      DisaggTwin: what the engine's HTTP layer calls, and its runner
    status.py    what /server_info, /v1/loads and /metrics show of it (pure)
    cli.py       the `gorgo engine` flags

May import the rest of emulator.engine and aiohttp; emulator.engine imports only twin,
prebuilt, status and config from here. This file imports nothing.
"""
