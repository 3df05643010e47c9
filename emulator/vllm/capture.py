"""Capture what a real vLLM engine says on the wire, into fixture files.

Run it by file path with the vLLM venv's python (it needs ``pyzmq`` and ``msgspec``, which
vLLM brings, and imports nothing from this project), against an engine that serves the
tiny model (``serve.py``) and publishes KV events to ``--kv-endpoint``::

    VENV/bin/python emulator/vllm/capture.py full --base-url http://127.0.0.1:8101 \\
        --kv-endpoint tcp://127.0.0.1:5557 --kv-bind --out tests/fixtures/vllm
    VENV/bin/python emulator/vllm/capture.py small-pool --base-url http://127.0.0.1:8102 \\
        --kv-endpoint tcp://127.0.0.1:5558 --kv-bind --out tests/fixtures/vllm

``--kv-bind``: the subscriber binds the endpoint (the engine was started with a
``tcp://127.0.0.1:PORT`` endpoint, which it connects to); without it the subscriber
connects (the engine bound ``tcp://*:PORT``). The subscriber is up before the first request:
events published before it are lost.

``full`` writes routes.json, sse-chat.txt, sse-chat-cached.txt, sse-chat-cached.json,
errors.json, metrics.txt (taken while 3 requests run), metrics-busy.txt (taken during the
long-prompt load), kv_events.jsonl and timings.json. ``small-pool`` sends 6 concurrent
~2,000-token prompts and writes metrics-small-pool-busy.txt, kv_events-small-pool.jsonl
and timings-small-pool.json. ``reset`` (an engine started with ``VLLM_SERVER_DEV_MODE=1``)
sends a prompt, resets the prefix cache twice and sends it again: kv_events-reset.jsonl
(with ``AllBlocksCleared``) and timings-reset.json.
"""

import argparse
import base64
import http.client
import importlib
import json
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

MODEL = "tiny"


# --- KV events -------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return {"bytes_hex": bytes(value).hex()}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str | float):
        return value
    if isinstance(value, int):
        return int(value)
    return repr(value)


class KvSubscriber:
    """A SUB socket on all topics, recording every multipart message with its arrival time."""

    def __init__(self, endpoint: str, bind: bool) -> None:
        import zmq

        self._zmq = zmq
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVHWM, 100000)
        if bind:
            self.sock.bind(endpoint)
        else:
            self.sock.connect(endpoint)
        self.messages: list[tuple[float, list[bytes]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = self._zmq.Poller()
        poller.register(self.sock, self._zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(100):
                while True:
                    try:
                        frames = self.sock.recv_multipart(flags=self._zmq.NOBLOCK)
                    except self._zmq.Again:
                        break
                    self.messages.append((time.time(), frames))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(linger=0)
        self.ctx.term()

    def write_jsonl(self, path: Path) -> list[dict[str, Any]]:
        msgspec = importlib.import_module("msgspec")

        rows = []
        for received, frames in self.messages:
            row: dict[str, Any] = {"received": round(received, 6), "n_frames": len(frames)}
            if len(frames) == 3:
                topic, seq, payload = frames
                try:
                    row["topic"] = topic.decode("utf-8")
                except UnicodeDecodeError:
                    row["topic_hex"] = topic.hex()
                row["seq"] = int.from_bytes(seq, "big", signed=True)
                row["seq_hex"] = seq.hex()
                row["payload_b64"] = base64.b64encode(payload).decode("ascii")
                try:
                    row["payload"] = _jsonable(msgspec.msgpack.decode(payload))
                except Exception as e:  # keep the raw bytes if it does not decode
                    row["payload_error"] = repr(e)
            else:
                row["frames_b64"] = [base64.b64encode(f).decode("ascii") for f in frames]
            rows.append(row)
        with path.open("w") as f:
            for row in rows:
                f.write(json.dumps(row, separators=(",", ":")) + "\n")
        return rows


# --- HTTP ------------------------------------------------------------------------------


class Http:
    def __init__(self, base_url: str) -> None:
        u = urlsplit(base_url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80

    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=120)

    def request(
        self, method: str, path: str, body: Any = None, raw: bytes | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        c = self.conn()
        headers: dict[str, str] = {}
        data = raw
        if body is not None:
            data = json.dumps(body).encode()
        if data is not None:
            headers["Content-Type"] = "application/json"
        c.request(method, path, body=data, headers=headers)
        r = c.getresponse()
        content = r.read()
        c.close()
        return r.status, dict(r.getheaders()), content

    def stream_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST a streaming chat; the raw SSE bytes, headers and timings."""
        c = self.conn()
        t0 = time.perf_counter()
        c.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
        )
        r = c.getresponse()
        t_headers = time.perf_counter()
        raw = bytearray()
        first_chunk = first_token = None
        usage = None
        n_token_chunks = 0
        while True:
            line = r.readline()
            if not line:
                break
            raw += line
            if not line.startswith(b"data: "):
                continue
            now = time.perf_counter()
            first_chunk = first_chunk or now
            data = line[6:].strip()
            if data == b"[DONE]":
                continue
            try:
                event = json.loads(data)
            except ValueError:
                continue
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    n_token_chunks += 1
                    first_token = first_token or now
            if event.get("usage"):
                usage = event["usage"]
        t_end = time.perf_counter()
        c.close()
        return {
            "status": r.status,
            "headers": dict(r.getheaders()),
            "raw": bytes(raw),
            "usage": usage,
            "ttfb_s": t_headers - t0,
            "first_chunk_s": (first_chunk - t0) if first_chunk else None,
            "ttft_s": (first_token - t0) if first_token else None,
            "e2e_s": t_end - t0,
            "content_chunks": n_token_chunks,
        }


def chat(content: str, max_tokens: int, stream: bool = True, **extra: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return body


def prose(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    syll = ["ka", "lo", "mi", "ter", "van", "sho", "ru", "pel", "dan", "io", "ze", "bra", "quo"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 3))) for _ in range(n_words)]
    return " ".join(words)


def prompt_of_tokens(h: Http, seed: int, target: int) -> tuple[str, int]:
    """A user message whose chat prompt is close to ``target`` tokens (checked by /tokenize)."""
    n_words = max(target // 2, 10)
    for _ in range(8):
        text = prose(seed, n_words)
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "add_generation_prompt": True,
        }
        status, _, content = h.request("POST", "/tokenize", body)
        count = json.loads(content)["count"] if status == 200 else n_words * 2
        if abs(count - target) <= max(target // 50, 8):
            return text, count
        n_words = max(int(n_words * target / count), 10)
    return text, count


def metric_value(page: str, name: str) -> float | None:
    for line in page.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def sample(content: bytes, limit: int = 600) -> object:
    try:
        value = json.loads(content)
        text = json.dumps(value)
        return value if len(text) <= limit else text[:limit] + "..."
    except ValueError:
        text = content.decode("utf-8", "replace")
        return text if len(text) <= limit else text[:limit] + "..."


def _background(
    fn: Callable[..., dict[str, Any]], *args: Any
) -> tuple[threading.Thread, list[dict[str, Any]]]:
    out: list[dict[str, Any]] = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    return t, out


def _meta(h: Http) -> dict[str, Any]:
    _, _, v = h.request("GET", "/version")
    return {"version": sample(v), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


# --- the two captures ------------------------------------------------------------------


def capture_full(h: Http, kv: KvSubscriber, out: Path) -> dict[str, Any]:
    timings: dict[str, Any] = {"meta": _meta(h)}
    routes: dict[str, Any] = {}
    for path in ("/health", "/v1/models", "/load", "/version", "/kv_event_sources", "/ping"):
        status, headers, content = h.request("GET", path)
        routes[f"GET {path}"] = {
            "status": status,
            "content_type": headers.get("content-type"),
            "body": sample(content),
        }
    status, headers, content = h.request("GET", "/metrics")
    routes["GET /metrics"] = {
        "status": status,
        "content_type": headers.get("content-type"),
        "bytes": len(content),
    }
    status, _, content = h.request("GET", "/openapi.json")
    if status == 200:
        paths = json.loads(content).get("paths", {})
        routes["GET /openapi.json"] = {
            "status": status,
            "paths": {p: sorted(m.upper() for m in ms) for p, ms in sorted(paths.items())},
        }
    for name, body in (
        ("prompt", {"model": MODEL, "prompt": "hello world"}),
        (
            "messages",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hello world"}],
                "add_generation_prompt": True,
            },
        ),
    ):
        status, _, content = h.request("POST", "/tokenize", body)
        routes[f"POST /tokenize ({name})"] = {
            "status": status,
            "request": body,
            "body": sample(content, 2000),
        }
    status, _, content = h.request("POST", "/detokenize", {"model": MODEL, "tokens": [74, 501]})
    routes["POST /detokenize"] = {"status": status, "body": sample(content)}
    status, _, content = h.request(
        "POST", "/v1/chat/completions", chat("Hello there.", 4, stream=False)
    )
    routes["POST /v1/chat/completions (stream false, max_tokens 4)"] = {
        "status": status,
        "body": sample(content, 3000),
    }
    status, _, content = h.request(
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "Hello there.", "max_tokens": 4, "ignore_eos": True},
    )
    routes["POST /v1/completions (max_tokens 4)"] = {
        "status": status,
        "body": sample(content, 3000),
    }

    # One streaming chat with usage.
    body = chat("Tell me a story.", 8)
    r = h.stream_chat(body)
    (out / "sse-chat.txt").write_bytes(r["raw"])
    routes["POST /v1/chat/completions (stream)"] = {
        "status": r["status"],
        "request": body,
        "response_headers": r["headers"],
    }
    timings["sse_chat"] = {
        k: r[k] for k in ("ttfb_s", "first_chunk_s", "ttft_s", "e2e_s", "content_chunks", "usage")
    }

    # The long prompt, twice: the second send hits the prefix cache.
    text, count = prompt_of_tokens(h, seed=1, target=1700)
    sends = []
    for i in range(2):
        body = chat(text, 16)
        r = h.stream_chat(body)
        sends.append(r)
        if i == 1:
            (out / "sse-chat-cached.txt").write_bytes(r["raw"])
    note = {
        "request": {**chat("<the long prompt>", 16), "prompt_tokens_by_tokenize": count},
        "first_send": {"usage": sends[0]["usage"], "ttft_s": sends[0]["ttft_s"]},
        "second_send": {"usage": sends[1]["usage"], "ttft_s": sends[1]["ttft_s"]},
    }
    (out / "sse-chat-cached.json").write_text(json.dumps(note, indent=1) + "\n")
    timings["long_prompt"] = note

    # A few more short streaming chats.
    timings["short_chats"] = []
    for i, msg in enumerate(("What is the weather?", "Count to ten.", "Write a haiku.")):
        r = h.stream_chat(chat(msg, 16))
        timings["short_chats"].append(
            {"ttft_s": r["ttft_s"], "e2e_s": r["e2e_s"], "usage": r["usage"], "n": i}
        )

    # Errors.
    errors = {}
    cases: dict[str, tuple[str, Any]] = {
        "unknown model": ("json", {**chat("hi", 4, stream=False), "model": "no-such-model"}),
        "malformed JSON body": ("raw", b'{"model": "tiny", "messages": [{"role": "user",'),
        "max_tokens 4096 (too large for the 4096 context)": (
            "json",
            chat("hi", 4096, stream=False),
        ),
        "missing messages": ("json", {"model": MODEL, "max_tokens": 4}),
        "unknown model (stream)": ("json", {**chat("hi", 4), "model": "no-such-model"}),
        "prompt longer than the context": ("json", chat(prose(7, 5000), 4, stream=False)),
        "long prompt (~1,700 tokens) with max_tokens 4096": (
            "json",
            chat(text, 4096, stream=False),
        ),
        "max_tokens 10000": ("json", chat("hi", 10000, stream=False)),
    }
    for name, (kind, payload) in cases.items():
        if kind == "raw":
            status, headers, content = h.request("POST", "/v1/chat/completions", raw=payload)
            req: Any = payload.decode()
        else:
            status, headers, content = h.request("POST", "/v1/chat/completions", payload)
            req = payload
            if name.startswith(("prompt longer", "long prompt")):
                req = {**payload, "messages": [{"role": "user", "content": "<the long prompt>"}]}
        entry = {
            "request": req,
            "status": status,
            "content_type": headers.get("content-type"),
            "body": sample(content, 3000),
        }
        if status == 200:  # accepted: keep what came back, not the random text
            value = json.loads(content)
            entry["body"] = {
                "usage": value.get("usage"),
                "finish_reason": value["choices"][0].get("finish_reason"),
            }
        errors[name] = entry
    (out / "errors.json").write_text(json.dumps(errors, indent=1) + "\n")

    # metrics-busy.txt: during the long prompt sent again with 2 new long prompts.
    texts = [text] + [prompt_of_tokens(h, seed=s, target=1700)[0] for s in (2, 3)]
    threads = [_background(h.stream_chat, chat(t, 600)) for t in texts]
    busy, best = None, -1.0
    time.sleep(0.3)
    for _ in range(40):
        _, _, content = h.request("GET", "/metrics")
        running = metric_value(content.decode(), "vllm:num_requests_running") or 0.0
        if running > best:
            busy, best = content.decode(), running
        if running >= 2:
            break
        time.sleep(0.2)  # each /metrics page costs the API server ~10-20 ms of CPU
    for t, _ in threads:
        t.join()
    if busy:
        (out / "metrics-busy.txt").write_text(busy)

    # metrics.txt: 3 short requests still running (long outputs keep them busy). On 2 cores
    # the API server gets little CPU while the engine decodes and answers /metrics late, with
    # a gauge that may be stale: try up to 3 times for a page that shows 2 or more running.
    page, best = "", -1.0
    polls = timings["metrics_polls_t_running"] = []
    timings["busy_requests"] = []
    for attempt in range(3):
        threads = [_background(h.stream_chat, chat(f"Busy request {i}.", 1200)) for i in range(3)]
        t0 = time.perf_counter()
        time.sleep(0.3)
        while any(t.is_alive() for t, _ in threads):
            _, _, content = h.request("GET", "/metrics")
            running = metric_value(content.decode(), "vllm:num_requests_running") or 0.0
            polls.append([attempt, round(time.perf_counter() - t0, 3), running])
            if running > best:
                page, best = content.decode(), running
            if running >= 3:
                break
            time.sleep(0.2)
        for t, _ in threads:
            t.join()
        timings["busy_requests"] += [
            {k: r[0][k] for k in ("status", "ttft_s", "e2e_s", "usage")} for _, r in threads
        ]
        if best >= 2:
            break
    (out / "metrics.txt").write_text(page)
    timings["metrics_running"] = metric_value(page, "vllm:num_requests_running")
    timings["routes"] = {"file": "routes.json"}
    (out / "routes.json").write_text(json.dumps(routes, indent=1) + "\n")
    return timings


def capture_small_pool(h: Http, out: Path) -> dict[str, Any]:
    timings: dict[str, Any] = {"meta": _meta(h)}
    texts = [prompt_of_tokens(h, seed=100 + i, target=2000) for i in range(6)]
    timings["prompt_tokens_by_tokenize"] = [c for _, c in texts]
    t0 = time.perf_counter()
    threads = [_background(h.stream_chat, chat(text, 64)) for text, _ in texts]
    best_page, best_waiting, samples = "", -1.0, []
    while any(t.is_alive() for t, _ in threads):
        _, _, content = h.request("GET", "/metrics")
        page = content.decode()
        waiting = metric_value(page, "vllm:num_requests_waiting") or 0.0
        running = metric_value(page, "vllm:num_requests_running") or 0.0
        usage = metric_value(page, "vllm:kv_cache_usage_perc")
        samples.append([round(time.perf_counter() - t0, 3), running, waiting, usage])
        if waiting > best_waiting:
            best_page, best_waiting = page, waiting
        time.sleep(0.1)
    for t, _ in threads:
        t.join()
    (out / "metrics-small-pool-busy.txt").write_text(best_page)
    timings["max_waiting"] = best_waiting
    timings["samples_t_running_waiting_kvusage"] = samples
    timings["requests"] = [
        {k: r[0][k] for k in ("status", "ttft_s", "e2e_s", "usage")} for _, r in threads
    ]
    # The same 6 again, one at a time: prefix hits on what eviction left.
    timings["again_sequential"] = []
    for text, _ in texts:
        r = h.stream_chat(chat(text, 4))
        timings["again_sequential"].append({"ttft_s": r["ttft_s"], "usage": r["usage"]})
    return timings


def capture_reset(h: Http, out: Path) -> dict[str, Any]:
    """AllBlocksCleared: a prompt, ``POST /reset_prefix_cache`` twice, the prompt again (the
    engine must run with ``VLLM_SERVER_DEV_MODE=1`` for that route)."""
    timings: dict[str, Any] = {"meta": _meta(h)}
    text = prose(1, 400)
    timings["first"] = h.stream_chat(chat(text, 8))["usage"]
    timings["resets"] = []
    for path in ("/reset_prefix_cache", "/reset_prefix_cache?reset_running_requests=true"):
        status, _, content = h.request("POST", path)
        timings["resets"].append({"path": path, "status": status, "body": sample(content)})
    timings["again"] = h.stream_chat(chat(text, 8))["usage"]
    return timings


def main() -> int:
    p = argparse.ArgumentParser(description="Capture a real vLLM engine's wire output.")
    p.add_argument("mode", choices=["full", "small-pool", "reset"])
    p.add_argument("--base-url", required=True)
    p.add_argument("--kv-endpoint", required=True)
    p.add_argument("--kv-bind", action="store_true", help="the subscriber binds the endpoint")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--settle",
        type=float,
        default=1.5,
        help="seconds to let the SUB socket connect before the first request",
    )
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    h = Http(a.base_url)
    kv = KvSubscriber(a.kv_endpoint, a.kv_bind)
    time.sleep(a.settle)
    t0 = time.perf_counter()
    if a.mode == "full":
        timings = capture_full(h, kv, a.out)
        suffix = ""
    elif a.mode == "small-pool":
        timings = capture_small_pool(h, a.out)
        suffix = "-small-pool"
    else:
        timings = capture_reset(h, a.out)
        suffix = "-reset"
    time.sleep(1.0)  # the last events
    kv.close()
    rows = kv.write_jsonl(a.out / f"kv_events{suffix}.jsonl")
    timings["kv_messages"] = len(rows)
    timings["capture_s"] = time.perf_counter() - t0
    (a.out / f"timings{suffix}.json").write_text(json.dumps(timings, indent=1) + "\n")
    print(
        json.dumps(
            {k: v for k, v in timings.items() if k != "samples_t_running_waiting_kvusage"}, indent=1
        )[:6000]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
