"""The replay's pure core: requests from trace rows, what is kept of the answer, the
progress line and the options; and its figure without a server. Its asyncio shell over
real sockets: tests/component/loadgen/replay/test_replay.py (its concurrency cap:
tests/unit/loadgen/client/test_concurrency.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ext_proc.prompt.tokens import count_tokens
from loadgen.client.concurrency import Admitted
from loadgen.client.stream import Result
from loadgen.replay.loop import Progress, ReplayRun, Sent
from loadgen.replay.plots import plot_run
from loadgen.replay.requests import build_request, to_result
from loadgen.replay.run import ReplayOptions
from loadgen.results import RequestResult
from loadgen.traces.prompts import PromptSynth
from loadgen.traces.request import TraceRequest


def mooncake_row(n_in: int = 1300, n_out: int = 17) -> TraceRequest:
    return TraceRequest(3, 0.0, n_in, n_out, (0, 5, 6), 512, "s5")


def test_mooncake_rows_become_streamed_completions_of_exact_length() -> None:
    req = build_request(mooncake_row(), "completions", PromptSynth())
    assert req.path == "/v1/completions"
    assert req.headers == {"x-session-id": "s5"}
    prompt = req.body.pop("prompt")
    assert count_tokens(prompt) == 1300
    assert req.body == {
        "model": "default",
        "max_tokens": 17,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_chat_api_sends_the_same_text_as_one_user_message() -> None:
    synth = PromptSynth()
    chat = build_request(mooncake_row(), "chat", synth)
    completion = build_request(mooncake_row(), "completions", synth)
    assert chat.path == "/v1/chat/completions"
    assert chat.body["messages"] == [{"role": "user", "content": completion.body["prompt"]}]
    assert chat.body["max_tokens"] == 17 and chat.body["ignore_eos"] and chat.body["stream"]
    with pytest.raises(ValueError, match="api"):
        build_request(mooncake_row(), "generate", synth)


def test_art_chat_rows_send_their_own_body_streamed_with_usage() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": False,
        "stream_options": {"continuous_usage_stats": True},
        "max_completion_tokens": 99,
        "temperature": 0.3,
    }
    r = TraceRequest(0, 0.0, 5, 99, (0,), 256, "uabc", body)
    req = build_request(r, "completions", PromptSynth())  # the row's own API wins
    assert req.path == "/v1/chat/completions" and req.headers == {"x-session-id": "uabc"}
    assert req.body == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"continuous_usage_stats": True, "include_usage": True},
        "max_completion_tokens": 99,
        "max_tokens": 99,
        "temperature": 0.3,
    }
    assert body["stream"] is False  # the trace's own row is left alone


def test_client_results_map_to_the_shared_schema() -> None:
    r = mooncake_row()
    ok = Result("t3", "eu", 200, 12.5, 80.0, [1.0, 2.0], 17, 1300, 512, chunks=17)
    row = to_result(r, ok)
    assert (row.status, row.error, row.backend, row.ttft_ms, row.itl_ms) == (
        "ok",
        "",
        "eu",
        12.5,
        [1.0, 2.0],
    )
    assert (row.input_tokens, row.output_tokens, row.cached_tokens) == (1300, 17, 512)
    # no usage chunk from the server: content chunks stand in for output tokens
    assert to_result(r, Result("t3", status=200, chunks=9)).output_tokens == 9
    assert to_result(r, Result("t3", status=503)).error == "HTTP 503"
    down = to_result(r, Result("t3", error="ClientConnectorError: refused"))
    assert (down.status, down.error) == ("error", "ClientConnectorError: refused")


def test_progress_line() -> None:
    p = Progress(total=4, duration_s=60.0)
    assert "0/4 done" in p.line(0.0) and "TTFT p50 - p95 - ms" in p.line(0.0)
    for slip_s in (0.0, 0.002, 0.030):
        p.sent(slip_s)
    p.finished(True, 100.0)
    p.finished(False, None)
    line = p.line(12.0)
    assert "2/4 done | 1 in flight | 1 errors | TTFT p50 100 p95 100 ms" in line
    assert "slip p95 27 max 30 ms | 12/60 s" in line


def test_options_are_checked() -> None:
    assert ReplayOptions("t.jsonl", "http://h:1").problems() == []
    bad = ReplayOptions(
        "t.jsonl",
        "h:1",
        api="x",
        time_scale=0.0,
        max_concurrency=0,
        start_s=-1.0,
        duration_s=0.0,
        limit=0,
        timeout_s=0.0,
    ).problems()
    assert [p.split()[0] for p in bad] == [
        "--url",
        "--api",
        "--time-scale",
        "--max-concurrency",
        "--start-s",
        "--duration-s",
        "--limit",
        "--timeout-s",
    ]


def test_plot_run_writes_a_png(tmp_path: Path) -> None:
    def item(i: int, ttft_ms: float | None, status: str) -> Sent:
        r = TraceRequest(i, float(i), 20, 4, (i,), 512, "s")
        return Sent(
            r,
            Admitted(i, float(i), float(i), False),
            float(i),
            RequestResult(r.id, ttft_ms=ttft_ms, status=status),
        )

    run = ReplayRun(
        [item(0, 120.0, "ok"), item(1, 80.0, "ok"), item(2, None, "error")], 3, "", 2.0, False
    )
    path = tmp_path / "figs" / "run.png"
    plot_run(path, run, "a title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
