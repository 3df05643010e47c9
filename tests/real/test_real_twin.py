"""The vLLM twin tokenizes as the real vLLM does, and `gorgo up --engine vllm --kv-events
--front-doors 2` wires the real engine's KV events into both routers' config.

One real vLLM (the tiny model, --trust-request-chat-template) behind two front doors, and
one `gorgo engine --flavor vllm` with its default tokenizer (the same model's, built into
the cache). The same bodies go to both engines' /tokenize, /v1/chat/completions and
/v1/completions: the same token ids, counts and refusals."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from emulator.stack.ports import free_ports
from emulator.stack.settings import Region, StackPorts, StackSettings
from emulator.stack.stack import Stack
from emulator.stack.supervision import http_ok
from emulator.vllm.tiny import ensure_tiny_model
from tests.e2e.stack_harness import get_json, wait_for

pytestmark = pytest.mark.real

REGION = Region("us-ashburn", 1.0)
DOOR = "eu-frankfurt"
HI = [{"role": "user", "content": "hi"}]
CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Read this:\n" + "doc7 alpha beta gamma " * 30},
    {"role": "assistant", "content": "Done, ünïcödé and all."},
    {"role": "user", "content": "And in one word?"},
]
# Prints what the template is given: tool-call arguments as vLLM hands them over.
SHOW = (
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %} {{ c.function.arguments | tojson }}{% endfor %}\n"
    "{% endfor %}{{ extra | default('') }}"
)
CALLS = [
    *HI,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": a}}
            for i, a in enumerate(['{"city": "Ashburn", "n": 3}', "{oops", "[1, 2]", ""])
        ],
    },
    {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
]
TOKENIZE = [
    {"prompt": "hello world"},
    {"prompt": 'Hello, world! def f(x): return 3 + y\n\n  {"k": [1]}', "add_special_tokens": False},
    {"prompt": "hello world", "return_token_strs": True},
    {"messages": HI},
    {"messages": CHAT},
    {"messages": CHAT, "add_generation_prompt": False},
    {
        "messages": [*HI, {"role": "assistant", "content": "Sure, "}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    {"messages": CALLS, "chat_template": SHOW, "chat_template_kwargs": {"extra": "!"}},
]
REFUSED = [
    ({"messages": HI, "continue_final_message": True}, 400),  # with add_generation_prompt
    ({"model": "no-such-model", "prompt": "x"}, 404),
]


def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Stack, str]]:
    settings = StackSettings(
        policy="round_robin",
        regions=(REGION,),
        ports=StackPorts.ephemeral(1),
        real_engine=True,
        vllm_small_pool=(),
        vllm_args=("--trust-request-chat-template",),
        kv_events=True,
        front_door_regions=(DOOR,),
        share_dispatches=False,
        probe_interval_s=0.5,
        tuner_mode="off",
    )
    ensure_tiny_model(settings.vllm_venv)
    stack = Stack(settings)
    (port,) = free_ports(1)
    flags = "--flavor vllm --max-model-len 4096 --trust-request-chat-template"
    flags += " --enable-prompt-tokens-details --name twin"
    twin = subprocess.Popen(
        [sys.executable, "-m", "ext_proc.cli", "engine", "--port", str(port), *flags.split()],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        t0 = time.monotonic()
        stack.start()
        print(f"one vLLM, two front doors in {time.monotonic() - t0:.1f} s")
        twin_url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_ok(f"{twin_url}/health"), 30)
        yield stack, twin_url
    finally:
        twin.terminate()
        twin.wait(timeout=10)
        stack.stop()


def test_models_name_the_model_directories(engines: tuple[Stack, str]) -> None:
    stack, twin = engines
    (real,) = get_json(f"{stack.engine_url(0)}/v1/models")["data"]
    (ours,) = get_json(f"{twin}/v1/models")["data"]
    assert list(ours) == list(real) and ours["id"] == real["id"] == "tiny"
    assert real["root"] == str(ensure_tiny_model(stack.settings.vllm_venv))
    assert ours["max_model_len"] == real["max_model_len"] == 4096
    for name in ("tokenizer.json", "tokenizer_config.json"):
        mine, theirs = Path(ours["root"]) / name, Path(real["root"]) / name
        assert mine.read_bytes() == theirs.read_bytes(), name


def test_tokenize_gives_the_real_engines_ids(engines: tuple[Stack, str]) -> None:
    stack, twin = engines
    for body in TOKENIZE:
        real = post(f"{stack.engine_url(0)}/tokenize", {"model": "tiny", **body})
        ours = post(f"{twin}/tokenize", {"model": "tiny", **body})
        assert ours == real, body
        assert real[0] == 200 and real[1]["count"] > 0
    for body, status in REFUSED:
        (real_status, _), (our_status, _) = (
            post(f"{url}/tokenize", body) for url in (stack.engine_url(0), twin)
        )
        assert real_status == our_status == status, body


def test_requests_count_the_real_engines_prompt_tokens(engines: tuple[Stack, str]) -> None:
    """usage.prompt_tokens of chats (their template options included) and completions
    (special tokens added by default), the real engine's with prompt_tokens_details."""
    stack, twin = engines
    common = {"model": "tiny", "max_tokens": 1, "ignore_eos": True}
    for body in TOKENIZE:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        sent = {k: v for k, v in body.items() if k != "return_token_strs"}
        real = post(f"{stack.engine_url(0)}{path}", {**common, **sent})
        ours = post(f"{twin}{path}", {**common, **sent})
        assert real[0] == ours[0] == 200, (body, real, ours)
        tokens = post(f"{twin}/tokenize", {"model": "tiny", **sent})[1]["count"]
        assert ours[1]["usage"]["prompt_tokens"] == real[1]["usage"]["prompt_tokens"] == tokens
        assert real[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_both_routers_subscribe_to_the_real_engines_kv_events(
    engines: tuple[Stack, str],
) -> None:
    """Both routers' configs name the engine's endpoints (it binds them); each router
    connects and applies the blocks of what was served. (Whether it then predicts from
    them, prefix_state precise, is the router's tokenizer check.)"""
    stack, _ = engines
    pub, replay = stack.settings.kv_event_ports(0)
    (door,) = stack.doors
    for cfg in (stack.config, door.config):
        (backend,) = cfg.backends
        assert (backend.kv_events.endpoint, backend.kv_events.replay_endpoint) == (
            f"tcp://127.0.0.1:{pub}",
            f"tcp://127.0.0.1:{replay}",
        )
    admins = [stack.admin_url, door.admin_url]
    text = "doc9 alpha beta gamma " * 80  # ~1,000 tokens: several 128-token blocks
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    status, out = post(f"{stack.front_door_url}/v1/chat/completions", body)
    assert status == 200 and out["usage"]["prompt_tokens"] > 4 * 128
    # --enable-prompt-tokens-details (README's flags): the report reaches the client
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0

    def kv(admin: str) -> dict[str, Any]:
        state = get_json(f"{admin}/state")["backends"][REGION.id]
        return {"prefix_state": state["prefix_state"], **(state.get("kv_events") or {})}

    wait_for(lambda: all(kv(a).get("blocks", 0) >= 4 for a in admins), 15)
    seen = [kv(a) for a in admins]
    print("per router: " + "; ".join(
        f"{s['blocks']} blocks, stream up {s['up']}, {s['prefix_state']}" for s in seen
    ))  # fmt: skip
    assert all(s["block_size"] == 128 and s["gaps"] == 0 for s in seen)
