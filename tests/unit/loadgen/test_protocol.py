"""The client protocol (loadgen.protocol), alike in `gorgo replay` and `gorgo simulate`:
presets and overrides, truncation, the live replay's cap against a fake streaming server,
and the command line's flags."""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web

from ext_proc.cli import main
from loadgen.protocol import OPEN, PAPER, Protocol, protocol_for
from loadgen.replay import ReplayOptions, run_replay
from loadgen.replay_loop import replay
from loadgen.results import summarize
from loadgen.traces import TraceRequest, write_mooncake


def rows(short: int, long: int = 0) -> list[TraceRequest]:
    """`short` 600-token prompts at 0 s, then `long` 30,000-token ones at 10 ms; 300
    tokens out; each its own session and blocks."""
    specs = [(600, 0.0)] * short + [(30_000, 0.01)] * long
    return [
        TraceRequest(i, t, n, 300, tuple(range(i * 100, i * 100 - (-n // 512))), 512, f"s{i}")
        for i, (n, t) in enumerate(specs)
    ]


def test_presets_and_overrides() -> None:
    assert (PAPER.max_concurrency, PAPER.max_tokens, PAPER.max_input_tokens) == (64, 128, 24_000)
    assert (OPEN.name, PAPER.name) == ("open", "paper")
    assert protocol_for("paper") == PAPER and protocol_for() == OPEN
    mine = protocol_for("paper", max_concurrency=32)
    assert (mine.max_concurrency, mine.max_tokens, mine.name) == (32, 128, "custom")
    assert "64 requests in flight" in PAPER.describe() and "24,000" in PAPER.describe()
    assert "no concurrency cap" in OPEN.describe()
    assert PAPER.meta() == {
        "name": "paper",
        "max_concurrency": 64,
        "max_tokens": 128,
        "max_input_tokens": 24_000,
    }


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"max_concurrency": 0}, "--max-concurrency"),
        ({"max_tokens": -1}, "--max-tokens"),
        ({"max_input_tokens": 0}, "--max-input-tokens"),
    ],
)
def test_bad_values_name_their_flag(kwargs: dict[str, int], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        Protocol(**kwargs)
    with pytest.raises(ValueError, match="--protocol"):
        protocol_for("closed")


def test_apply_forces_output_lengths_and_drops_long_prompts_keeping_ids() -> None:
    trace = rows(3, long=2)
    kept, dropped = PAPER.apply(trace)
    assert dropped == 2 and [r.id for r in kept] == ["t0", "t1", "t2"]
    assert all(r.output_tokens == 128 for r in kept)
    assert Protocol(max_tokens=7).apply(trace) == ([replace(r, output_tokens=7) for r in trace], 0)
    assert Protocol(max_input_tokens=600).apply(trace)[1] == 2  # "over N" drops, N stays
    assert OPEN.apply(trace) == (trace, 0)


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


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


# ---------------------------------------------------------------------------------------
# The command line.


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--max-concurrency", "0"), ("--max-tokens", "0"), ("--max-input-tokens", "-5")],
)
def test_simulate_rejects_bad_protocol_values_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    path = write_mooncake(tmp_path / "t.jsonl", rows(2))
    assert main(["simulate", str(path), "--out", str(tmp_path / "o"), flag, value]) == 2
    assert flag in capsys.readouterr().err


def test_simulate_under_the_paper_protocol_records_it(tmp_path: Path) -> None:
    path = write_mooncake(tmp_path / "t.jsonl", rows(4, long=1))
    out = tmp_path / "o"
    args = ["simulate", str(path), "--out", str(out), "--protocol", "paper"]
    assert main([*args, "--max-concurrency", "2", "--policy", "round_robin"]) == 0
    doc = json.loads((out / "round_robin-ts1.json").read_text())
    assert doc["meta"]["protocol"] == {**PAPER.meta(), "name": "custom", "max_concurrency": 2}
    assert doc["meta"]["dropped"] == 1 and len(doc["requests"]) == 4
    assert all(r["output_tokens"] == 128 for r in doc["requests"])
    assert doc["summary"]["slip_ms"]["waited"] == 2  # four at once, two slots
    md = (out / "summary.md").read_text()
    assert "protocol `custom`" in md and "slip p95" in md and "1 dropped" in md
