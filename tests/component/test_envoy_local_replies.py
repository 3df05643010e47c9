"""Envoy's own error answers in the generated front door, from the real Envoy binary: in
OpenAI's error shape, with the type, code and param ext_proc/vocab/errors.py names for
them (the router's own answers: tests/unit/vocab/test_errors.py; a body over the buffer
limit, 413, which needs the router to buffer it: tests/e2e/test_user_faults.py). No
router and no engine run: requests fail open to the fallback route, whose backend refuses
connections (503) or never answers (504, past the route's timeout)."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from emulator.stack.ports import free_ports
from emulator.stack.processes import envoy_binary
from ext_proc.config.load import config_from_dict
from ext_proc.envoy_config.bootstrap import render_envoy_config
from ext_proc.vocab.errors import UNAVAILABLE, UPSTREAM_TIMEOUT, ApiError

pytestmark = pytest.mark.component


@contextmanager
def front_door(tmp: Path, backend_port: int, route_timeout_s: float = 600.0) -> Iterator[str]:
    """The generated front door, its one backend on `backend_port`."""
    listen, admin, grpc = free_ports(3)
    cfg = config_from_dict(
        {
            "listen": {"grpc": f"127.0.0.1:{grpc}"},  # nothing listens: fail open
            "envoy": {
                "listen": f"127.0.0.1:{listen}",
                "admin": f"127.0.0.1:{admin}",
                "route_timeout_s": route_timeout_s,
            },
            "backends": [{"id": "only", "address": f"127.0.0.1:{backend_port}"}],
        }
    )
    path = tmp / "envoy.yaml"
    path.write_text(render_envoy_config(cfg))
    proc = subprocess.Popen(
        [envoy_binary(), "-c", str(path), "--disable-hot-restart", "-l", "error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline, "Envoy did not start"
                time.sleep(0.05)
        yield f"http://127.0.0.1:{listen}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def post(url: str) -> tuple[int, str, dict[str, object]]:
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", data=CHAT, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers["content-type"], json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers["content-type"], json.loads(e.read())


def assert_error(answer: tuple[int, str, dict[str, object]], error: ApiError, words: str) -> None:
    status, content_type, body = answer
    assert (status, content_type) == (error.status, "application/json"), body
    assert body == error.as_json(body["error"]["message"])  # type: ignore[index]
    assert words in body["error"]["message"].lower()  # type: ignore[index]  # Envoy's own


CHAT = b'{"messages": [{"role": "user", "content": "hi"}]}'


def test_a_backend_refusing_connections_gets_a_json_503(tmp_path: Path) -> None:
    (dead,) = free_ports(1)
    with front_door(tmp_path, dead) as url:
        assert_error(post(url), UNAVAILABLE, "upstream connect error")


def test_a_backend_that_never_answers_gets_a_json_504(tmp_path: Path) -> None:
    with socket.socket() as silent:  # the kernel accepts its connections; nobody answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        with front_door(tmp_path, silent.getsockname()[1], route_timeout_s=0.3) as url:
            assert_error(post(url), UPSTREAM_TIMEOUT, "timeout")
