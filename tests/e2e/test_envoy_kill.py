"""Envoy killed (-9) while long streams are open past their first token: the router closes
their requests as lost within seconds, so its accounting (/state `in_flight`) and its
queue estimates agree again (issue 51: they used to stay counted until they expired)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from emulator.stack.stack import Stack
from loadgen.client.stream import CHAT_PATH, chat_body
from tests.e2e.conftest import FAST_ENGINE, fast_settings
from tests.e2e.stack_harness import router_state, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.long]

STREAMS = 8
# Decode steps of 20 ms: 3,000 tokens stream for about a minute, so every stream is still
# open when Envoy dies.
SLOW_DECODE = (*FAST_ENGINE, "--set", "decode_base_ms=20")


@pytest.fixture
def stack() -> Iterator[Stack]:
    s = Stack(fast_settings("gorgo", engine_args=SLOW_DECODE, tuner_mode="off"))
    s.start()
    yield s
    s.stop()


class OpenStream:
    """One streamed chat through the front door, read up to its first content chunk and
    then left open (a thread drains it until the connection ends)."""

    def __init__(self, port: int, i: int) -> None:
        body = json.dumps(chat_body(f"stream {i} " * 40, 3000)).encode()
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        head = (
            f"POST {CHAT_PATH} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        self.sock.sendall(head.encode() + body)
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        seen = b""
        try:
            while chunk := self.sock.recv(65536):
                seen += chunk if not self.first.is_set() else b""
                if b'"content"' in seen:
                    self.first.set()
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        self.thread.join(timeout=5)


def waiting_first_byte(state: dict[str, Any]) -> int:
    return sum(int(b["waiting_first_byte"]) for b in state["backends"].values())


def test_envoy_killed_with_streams_open_closes_them_within_10_s(stack: Stack) -> None:
    port = stack.settings.ports.front_door
    streams = [OpenStream(port, i) for i in range(STREAMS)]
    try:
        for s in streams:
            assert s.first.wait(timeout=30), "a stream got no first token"
        # past the first token as the router sees it too (the observer's message comes
        # over its own stream): nothing of them waits for a first byte any more
        wait_for(lambda: waiting_first_byte(router_state(stack)) == 0)
        assert router_state(stack)["in_flight"] == STREAMS
        os.kill(stack.procs["envoy"].pid, signal.SIGKILL)  # a crash: not Stack.kill
        killed = time.monotonic()
        wait_for(lambda: router_state(stack)["in_flight"] == 0, timeout_s=10)
        to_zero_s = time.monotonic() - killed
        print(f"in_flight {STREAMS} -> 0 in {to_zero_s:.2f} s after Envoy's kill -9")
        state = router_state(stack)
        for b in state["backends"].values():  # the estimates agree with the accounting
            assert b["in_flight"] == 0 and b["waiting_first_byte"] == 0
            assert b["queue_ms"] == 0
        # lost with their Envoy, not held against the backends
        assert sum(b["lost"] for b in state["backends"].values()) == STREAMS
        assert sum(b["errors"] for b in state["backends"].values()) == 0
    finally:
        for s in streams:
            s.close()
