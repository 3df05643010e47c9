"""The engine twin: one emulated SGLang or vLLM backend (`gorgo engine`).

    server.py       the HTTP layer: Engine's handlers, make_app, EngineServer
    status.py       what it reports: /v1/loads, /server_info, /metrics, /stats (pure)
    config.py       what one engine is configured with, and its fault flags
    parse.py        request bodies, tokenized as the engine tokenizes (pure)
    wire.py         response bodies and SSE chunks in each flavor's shapes (pure)
    chat.py         a chat's prompt as each engine renders it
    model_api.py    /v1/models, /get_model_info, the tokenize endpoints, LoRA loads (pure)
    tokenizer.py    the twin's tokenizer: the tiny model's, built once into a cache
    lora.py         LoRA adapters: names, loads, cache namespaces, lora_requests_info
    kv_publisher.py KV events as the engines publish them (ZMQ PUB, replay ROUTER)
    model/          the engine model: FCFS, chunked prefill, batching (scheduler.py) on
                    its queues and KV books (queues.py); pure, the simulator runs it too
    prefix_cache.py the model's radix prefix cache; priority.py its priority scheduling
    runner.py       drives the model in real time; counters and histograms
    calibrate.py    `gorgo bench engine-model`: the model against its calibration targets

May import emulator.vllm.paths (the tiny model's recipe) and the router's profiles and
tokenizers; nothing of emulator.stack or the load generator. This file imports nothing.
"""
