"""The emulator (harness): the engine twin and the local stack.

    engine/   the emulated SGLang / vLLM engine: its HTTP layer, pure parsing and wire
              formats, the engine model shared with the simulator, tokenizer, LoRA, KV events
    stack/    `gorgo up`: every process of the local stack, their supervision, fleet files
    vllm/     a real vLLM on the CPU (the real-engine test tier)
    wan.py    the user-space WAN delay link (`gorgo wan`) and its delay model
    cli.py    `gorgo engine`, `wan`, `up`, `bench engine-model`

engine/ imports nothing of stack/; stack/ starts engines as processes (it imports engine/
for LoRA names and to build the tiny tokenizer once). Nothing here imports the load
generator; the router never imports this package. This file imports nothing.
"""
