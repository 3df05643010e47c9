"""The replay over real sockets: against a port where nothing listens (every request an
error, the cap, a stop), against a fake streaming server that counts what is in flight
(the protocol's cap, TTFT from dispatch), `run_replay` under the paper protocol; and, in a
fresh interpreter, the replay module without matplotlib. The pure core:
tests/unit/loadgen/replay/test_replay.py and tests/unit/loadgen/client/test_protocol.py."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

from loadgen.client.protocol import PAPER
from loadgen.replay.loop import replay
from loadgen.replay.run import ReplayOptions, run_replay
from loadgen.results import summarize
from loadgen.traces.readers import write_mooncake
from loadgen.traces.request import TraceRequest
from tests.trace_rows import rows


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_replay_against_nothing_records_every_request_as_an_error() -> None:
    trace = [TraceRequest(i, i * 0.01, 20, 4, (i,), 512, f"s{i}") for i in range(3)]
    out = io.StringIO()
    run = await replay(trace, f"http://127.0.0.1:{closed_port()}", progress=out)
    assert (run.planned, len(run.sent), run.interrupted) == (3, 3, False)
    assert [s.request.id for s in run.sent] == ["t0", "t1", "t2"]  # in schedule order
    assert [s.index for s in run.sent] == [0, 1, 2]
    assert all(r.status == "error" and r.error for r in run.results)
    assert all(s.slip_s >= 0 for s in run.sent) and run.wall_s > 0
    # no terminal: one plain line at the end, no carriage return or escape code
    assert out.getvalue().startswith("replay 3/3 done | 0 in flight | 3 errors")
    assert out.getvalue().count("\n") == 1 and out.getvalue()[-1] == "\n"
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


class Terminal(io.StringIO):
    """Output that says it is a terminal, as a user's stderr does."""

    def isatty(self) -> bool:
        return True


async def test_on_a_terminal_the_replay_draws_a_bar_of_requests_done() -> None:
    trace = [TraceRequest(i, i * 0.01, 20, 4, (i,), 512, f"s{i}") for i in range(3)]
    out = Terminal()
    await replay(trace, f"http://127.0.0.1:{closed_port()}", progress=out)
    drawn = out.getvalue().split("\r")
    assert len(drawn) >= 2 and drawn[-1].endswith("\n")  # redrawn in place, then left
    last = drawn[-1]
    assert last.startswith("replay: 100%") and "3/3" in last and "3 errors" in last


async def test_a_full_cap_sends_the_next_request_when_a_slot_frees() -> None:
    trace = [TraceRequest(i, 0.0, 20, 4, (i,), 512, f"s{i}") for i in range(3)]
    run = await replay(trace, f"http://127.0.0.1:{closed_port()}", max_concurrency=1)
    assert [s.index for s in run.sent] == [0, 1, 2]
    assert [s.dispatch.throttled for s in run.sent] == [False, True, True]
    slips = [s.slip_s for s in run.sent]
    assert 0 <= slips[0] <= slips[1] <= slips[2] and slips[2] > 0


async def test_a_replay_stopped_before_it_starts_sends_nothing() -> None:
    stop = asyncio.Event()
    stop.set()
    trace = [TraceRequest(0, 0.0, 20, 4, (0,), 512, "s0")]
    run = await replay(trace, f"http://127.0.0.1:{closed_port()}", stop=stop)
    assert (run.planned, run.sent, run.interrupted) == (1, [], True)


def test_the_replay_module_does_not_import_matplotlib() -> None:
    code = "import sys, loadgen.replay.run; print('matplotlib' in sys.modules)"
    root = Path(__file__).resolve().parents[4]
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert res.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------
# The live replay's cap, against a fake streaming server that counts what is in flight.


class FakeServer:
    """Streams a completion: the first token after hold_s, a second, usage, [DONE]."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.in_flight = 0
        self.most = 0
        self.bodies: list[dict[str, object]] = []

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(self.hold_s)
            for chunk in (
                {"choices": [{"text": "a"}]},
                {"choices": [{"text": "b"}]},
                {"choices": [], "usage": {"prompt_tokens": 600, "completion_tokens": 2}},
            ):
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.in_flight -= 1


async def test_the_replay_holds_at_most_n_in_flight_and_times_from_dispatch() -> None:
    fake = FakeServer(hold_s=0.05)
    app = web.Application()
    app.router.add_post("/v1/completions", fake.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        run = await replay(rows(6), f"http://127.0.0.1:{port}", max_concurrency=2)
    finally:
        await runner.cleanup()
    assert fake.most == 2 and len(fake.bodies) == 6
    results = run.results
    assert all(r.status == "ok" for r in results), [r.error for r in results]
    slips = [r.slip_ms for r in results]
    assert all(s is not None for s in slips)
    # two at a time, 50 ms each: the last pair waited for two before it
    assert max(s for s in slips if s is not None) > 80
    # TTFT starts at dispatch: about one hold each, however long the wait before it
    assert all(r.ttft_ms is not None and r.ttft_ms < 45 + 50 for r in results)
    assert summarize(results)["slip_ms"]["waited"] >= 4


def test_run_replay_drops_long_prompts_and_records_the_protocol(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_mooncake(tmp_path / "t.jsonl", rows(3, long=2))
    out = tmp_path / "r.json"
    opts = ReplayOptions(
        str(path),
        f"http://127.0.0.1:{closed_port()}",
        protocol="paper",
        out=str(out),
        progress=False,
    )
    assert run_replay(opts) == 1  # nothing listens: every request failed, results written
    doc = json.loads(out.read_text())
    assert doc["meta"]["protocol"] == PAPER.meta() and doc["meta"]["dropped"] == 2
    assert doc["meta"]["max_concurrency"] == 64
    assert [r["id"] for r in doc["requests"]] == ["t0", "t1", "t2"]
    assert all(r["slip_ms"] is not None for r in doc["requests"])
    assert "dropped 2 of 5 requests" in capsys.readouterr().err
    bad = ReplayOptions(str(path), "http://h:1", max_tokens=0)
    assert any("--max-tokens" in p for p in bad.problems())
