"""`gorgo bench engine`: how faithfully one live `gorgo engine` keeps the model's schedule.

Starts one engine process with the default profile, opens N concurrent streams, and reads
the engine's own account (`/server_info` timing): how late each token left relative to the
model's schedule (p50/p95/p99/max), and the engine's CPU time per token written.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
import urllib.request

import aiohttp

from emulator.stack.ports import free_ports
from loadgen.client.stream import chat_body, send_chat

# Target from the issue: tokens leave within 1 ms (p95) of the model's schedule.
TARGET_LAG_P95_MS = 1.0


async def _drive(url: str, streams: int, output_tokens: int, prompt_tokens: int) -> int:
    rng = random.Random(0)

    async with aiohttp.ClientSession() as s:

        async def one(i: int) -> int:
            # unique prompts: no cache hits, every stream prefills
            text = "".join(f"{rng.randrange(1000):03d} " for _ in range(prompt_tokens))
            r = await send_chat(s, url, chat_body(text, output_tokens), f"e{i}")
            if not r.ok:
                raise RuntimeError(f"stream {i} failed: {r.status} {r.error}")
            return r.output_tokens

        return sum(await asyncio.gather(*(one(i) for i in range(streams))))


def run_engine_bench(streams: int = 64, output_tokens: int = 256, prompt_tokens: int = 1024) -> int:
    (port,) = free_ports(1)
    proc = subprocess.Popen(
        # the local stack's cache granularity (the profile's 64-token blocks, not SGLang's
        # default 1-token pages)
        [
            sys.executable,
            "-m",
            "ext_proc.cli",
            "engine",
            "--name",
            "bench",
            "--port",
            str(port),
            "--page-size",
            "64",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"{url}/v1/models", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    print("gorgo bench engine: the engine did not start", file=sys.stderr)
                    return 1
                time.sleep(0.05)
        print(f"{streams} streams x {output_tokens} tokens, {prompt_tokens}-token prompts...")
        t0 = time.perf_counter()
        tokens = asyncio.run(_drive(url, streams, output_tokens, prompt_tokens))
        wall_s = time.perf_counter() - t0
        with urllib.request.urlopen(f"{url}/server_info", timeout=5) as r:
            timing = json.load(r)["timing"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    print(f"tokens streamed: {tokens} in {wall_s:.1f} s (engine wrote {timing['tokens_written']})")
    print(
        f"emission lag vs the model's schedule (ms): p50 {timing['lag_ms_p50']}  "
        f"p95 {timing['lag_ms_p95']}  p99 {timing['lag_ms_p99']}  max {timing['lag_ms_max']}  "
        f"(target p95 <= {TARGET_LAG_P95_MS:g})"
    )
    print(f"engine CPU: {timing['cpu_s']} s, {timing['cpu_us_per_token']} us per token written")
    return 0
