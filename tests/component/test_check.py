"""`gorgo check` against engines on real sockets: emulated engines in process (the tiny
model's tokenizer, /metrics, KV events with replay) and fakes with behaviour where an
engine must misbehave (a /metrics that hangs or lacks the queue gauges, a port that accepts
and says nothing). It finds a wrong tokenizer, an unreachable metrics endpoint, an
unreachable KV endpoint and a backend serving another model, each with its fix, and says
all is well for a fleet whose every aspect is precise."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from emulator.engine.config import EngineConfig
from emulator.engine.kv_publisher import KvEventsConfig
from emulator.engine.server import EngineServer
from emulator.engine.tokenizer import load_twin_tokenizer
from ext_proc.cli import main
from ext_proc.config.load import config_from_dict
from ext_proc.service.check.judge import judge
from ext_proc.service.check.probes import Look, look_at_fleet
from ext_proc.service.check.report import as_json, render_text
from ext_proc.service.check.verdict import Verdict
from tests.component.engine_harness import FAST

TIMEOUT_S = 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Start = Callable[..., Any]


@pytest.fixture
async def engines() -> AsyncIterator[Start]:
    """Starts emulated engines (the tiny model's tokenizer; SGLang's twin unless told)."""
    started: list[EngineServer] = []

    async def start(model: str = "", **kw: Any) -> EngineServer:
        tokens = load_twin_tokenizer()
        cfg = EngineConfig(
            name=f"e{len(started)}",
            model=model or tokens.model_dir,
            profile=FAST,
            model_path=tokens.model_dir,
            tokenizer=tokens.tokenizer,
            chat_template=tokens.template,
            **{"enable_metrics": True, **kw},
        )
        srv = EngineServer(cfg, "127.0.0.1", 0)
        await srv.start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        await srv.stop()


async def check(raw: dict[str, Any]) -> tuple[Verdict, Look]:
    cfg = config_from_dict(raw)
    look = await look_at_fleet(cfg, TIMEOUT_S)
    return judge(cfg, look), look


def backend(srv: EngineServer, id: str = "a", **kw: Any) -> dict[str, Any]:
    return {"id": id, "address": f"127.0.0.1:{srv.port}", **kw}


def kv_engine() -> tuple[KvEventsConfig, dict[str, str]]:
    """An engine's kwargs publishing KV events with replay, and the backend's kv_events."""
    pub, replay = free_port(), free_port()
    events = KvEventsConfig(endpoint=f"tcp://*:{pub}", replay_endpoint=f"tcp://*:{replay}")
    kv = {"endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    return events, kv


def lines(verdict: Verdict) -> list[str]:
    return [p.line() for p in verdict.problems]


async def test_a_fleet_with_everything_precise_is_all_well(engines: Start) -> None:
    events, kv = kv_engine()
    srv = await engines(kv_events=events)
    verdict, look = await check({"backends": [backend(srv, kv_events=kv)]})
    assert lines(verdict) == [] and verdict.exit_code == 0
    (b,) = verdict.backends
    assert b.prefix.precise and b.prefix.how.startswith("the engine's KV events")
    assert "with replay" in b.prefix.how
    assert b.tokens.precise and b.tokens.how == f"verified against {srv.cfg.model}"
    assert b.queue.precise and "waiting 0, running 0" in b.queue.how
    assert b.rtt_ms is not None and b.rtt_ms > 0 and len(look.backends[0].rtt_ms) == 3
    assert verdict.tokenizer.startswith("found from a: ")  # as the router finds it
    (m,) = verdict.models
    assert m.backends == m.prefix_precise == m.tokens_exact == m.queue_from_engine == ["a"]
    text = render_text("x.yaml", verdict, look)
    assert text.rstrip().endswith("gorgo check: all is well (1 backend, 1 model)")
    assert "  prefix  precise: the engine's KV events" in text


def other_tokenizer(into: Path) -> Path:
    """Another model's tokenizer: a byte-level BPE trained here on a few sentences, with
    the tiny model's ChatML template beside it (so only the ids differ)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["What is the weather like today in the city?"] * 20, trainer)
    into.mkdir()
    tok.save(str(into / "tokenizer.json"))
    tiny = Path(load_twin_tokenizer().model_dir)
    shutil.copy(tiny / "tokenizer_config.json", into / "tokenizer_config.json")
    return into / "tokenizer.json"


async def test_a_wrong_tokenizer_is_found_with_its_fix(engines: Start, tmp_path: Path) -> None:
    events, kv = kv_engine()
    srv = await engines(kv_events=events)
    wrong = other_tokenizer(tmp_path / "other")
    raw = {"backends": [backend(srv, kv_events=kv)], "tokenizer": {"path": str(wrong)}}
    verdict, _ = await check(raw)
    (problem,) = verdict.problems
    assert problem.where == "backend a"
    assert problem.what.startswith("the engine tokenizes the probe chat differently: token")
    assert problem.fix.startswith("set tokenizer.path (and tokenizer.chat_template)")
    (b,) = verdict.backends
    assert not b.tokens.precise and not b.prefix.precise  # its KV events are of no use
    assert "tokens are not the engine's" in b.prefix.how and b.queue.precise
    assert verdict.tokenizer == f"configured: {wrong}" and verdict.exit_code == 1


async def test_metrics_that_sglang_does_not_serve_say_start_it_with_enable_metrics(
    engines: Start,
) -> None:
    srv = await engines(enable_metrics=False)
    verdict, _ = await check({"backends": [backend(srv)]})
    (problem,) = verdict.problems
    assert problem.what == f"http://127.0.0.1:{srv.port}/metrics answers 404"
    assert problem.fix.startswith("start SGLang with --enable-metrics")
    assert not verdict.backends[0].queue.precise
    assert verdict.backends[0].queue.how == "the router's own estimate (no /metrics)"


class FakeEngine:
    """An engine's HTTP surface with behaviour a test sets: the models it lists, and a
    /metrics page that answers with `metrics`, or hangs past any timeout."""

    def __init__(self, model: str = "m", metrics: str = "", hang_metrics: bool = False) -> None:
        self.model = model
        self.metrics = metrics or "sglang:num_queue_reqs 2\nsglang:num_running_reqs 1\n"
        self.hang_metrics = hang_metrics
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "root": ""}]})

    async def _metrics(self, _: web.Request) -> web.Response:
        if self.hang_metrics:
            await asyncio.sleep(3600)
        return web.Response(text=self.metrics)

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


@pytest.fixture
async def fakes() -> AsyncIterator[Callable[..., Any]]:
    started: list[FakeEngine] = []

    async def start(**kw: Any) -> FakeEngine:
        started.append(await FakeEngine(**kw).start())
        return started[-1]

    yield start
    for f in started:
        await f.stop()


async def test_an_unreachable_metrics_endpoint_is_a_problem(fakes: Any) -> None:
    hung = await fakes(hang_metrics=True)
    bare = await fakes(metrics="process_cpu_seconds_total 1.5\n")
    verdict, _ = await check(
        {"backends": [backend(hung, "hung"), backend(bare, "bare")], "models": []}
    )
    by_where = {p.where: p for p in verdict.problems}
    assert set(by_where) == {"backend hung", "backend bare"}
    assert by_where["backend hung"].what == (
        f"http://127.0.0.1:{hung.port}/metrics: no answer within {TIMEOUT_S:g} s"
    )
    assert "probes.metrics_interval_s: 0" in by_where["backend hung"].fix
    assert "sglang:num_queue_reqs or vllm:num_requests_waiting" in by_where["backend bare"].what
    assert [b.queue.precise for b in verdict.backends] == [False, False]


async def test_an_unreachable_kv_endpoint_is_a_problem_told_apart_from_a_wrong_one(
    engines: Start,
) -> None:
    events, _ = kv_engine()
    srv = await engines(kv_events=events)
    held: list[asyncio.StreamWriter] = []

    async def mute(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        held.append(w)  # accepted, held open, never answered

    silent = await asyncio.start_server(mute, "127.0.0.1", 0)
    mute_port = silent.sockets[0].getsockname()[1]
    replay = events.replay_endpoint.replace("*", "127.0.0.1")
    nothing = free_port()
    backends = [
        backend(srv, "none", kv_events={"endpoint": f"tcp://127.0.0.1:{nothing}"}),
        backend(srv, "mute", kv_events={"endpoint": f"tcp://127.0.0.1:{mute_port}"}),
        backend(srv, "router", kv_events={"endpoint": replay}),  # the replay ROUTER
        backend(
            srv,
            "replay",
            kv_events={
                "endpoint": events.endpoint.replace("*", "127.0.0.1"),
                "replay_endpoint": f"tcp://127.0.0.1:{nothing}",
            },
        ),
    ]
    try:
        verdict, _ = await check({"backends": backends})
    finally:
        silent.close()
        for w in held:
            w.close()
    said = {p.where.removeprefix("backend "): p for p in verdict.problems}
    assert set(said) == {"none", "mute", "router", "replay"}
    assert said["none"].what == (
        f"KV events: nothing accepts a connection at tcp://127.0.0.1:{nothing} (refused)"
    )
    assert said["none"].fix == (
        f'start the engine with --kv-events-config \'{{"publisher": "zmq", "endpoint": '
        f'"tcp://*:{nothing}"}}\', or correct backends[0].kv_events.endpoint'
    )
    assert "a TCP connection to" in said["mute"].what and "no ZMTP handshake" in said["mute"].what
    assert "not as a ZMQ publisher" in said["router"].what
    assert said["replay"].what.startswith("KV replay: no answer to a replay request")
    assert "backends[3].kv_events.replay_endpoint" in said["replay"].fix
    prefix = {b.id: b.prefix for b in verdict.backends}
    assert [prefix[b].precise for b in ("none", "mute", "router")] == [False] * 3
    assert prefix["replay"].precise  # its events are up; a gap would reset, not replay


async def test_a_backend_serving_another_model_is_a_problem(engines: Start) -> None:
    alpha1, alpha2, beta = [await engines(model=m) for m in ("alpha", "alpha", "beta")]
    fleet = [backend(alpha1, "a1"), backend(alpha2, "a2"), backend(beta, "b")]
    verdict, _ = await check({"backends": fleet})
    (problem,) = verdict.problems
    assert problem.line() == (
        "backend b: serves 'beta', the other backends 'alpha'. Fix: start its engine with "
        "'alpha', or, for a fleet of several models, list each backend's in backends[].models"
    )
    # The config names the model: the backend that does not serve it is named by its key.
    named = [backend(alpha1, "a1", models=["alpha"]), backend(beta, "b", models=["alpha"])]
    verdict, _ = await check({"backends": named})
    (problem,) = verdict.problems
    assert problem.what == "backends[1].models lists 'alpha', its engine serves 'beta'"
    assert problem.fix.endswith("or correct backends[1].models")
    # An alias whose served model no backend serves.
    aliased = {"backends": fleet[:2], "models": [{"name": "chat", "served": [{"model": "gpt"}]}]}
    verdict, _ = await check(aliased)
    (problem,) = verdict.problems
    assert problem.where == "fleet" and "models[0].served[0].model" in problem.fix


async def test_a_dead_fleet_answers_within_about_one_timeout(fakes: Any) -> None:
    """Three black holes (they accept and never answer): the backends are looked at
    concurrently, each request given up after the timeout."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        held.append(w)

    holes = [await asyncio.start_server(hold, "127.0.0.1", 0) for _ in range(3)]
    ports = [h.sockets[0].getsockname()[1] for h in holes]
    try:
        verdict, look = await check(
            {
                "backends": [
                    {"id": f"b{i}", "address": f"127.0.0.1:{p}"} for i, p in enumerate(ports)
                ]
            }
        )
    finally:
        for h in holes:
            h.close()
        for w in held:
            w.close()
    assert [p.what for p in verdict.problems] == [
        f"http://127.0.0.1:{p}/v1/models: no answer within {TIMEOUT_S:g} s" for p in ports
    ]
    assert look.elapsed_s < 4 * TIMEOUT_S  # one after another it would take 3 x 3 timeouts


async def test_the_json_output_says_the_same(fakes: Any) -> None:
    hung = await fakes(hang_metrics=True)
    verdict, look = await check({"backends": [backend(hung)]})
    doc = json.loads(json.dumps(as_json("c.yaml", verdict, look)))
    assert doc["ok"] is False and doc["exit_code"] == 1
    assert doc["problems"] == [
        {"where": p.where, "what": p.what, "fix": p.fix} for p in verdict.problems
    ]
    assert doc["backends"][0]["queue"]["precise"] is False
    assert doc["summary"] == "gorgo check: 1 problem (1 backend, 1 model)"


def test_exit_statuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends: [{id: a, address: 127.0.0.1:1}]\nrouting: {block_tokens: 0}\n")
    assert main(["check", "--config", str(bad)]) == 2
    assert "routing.block_tokens: must be > 0" in capsys.readouterr().err
    dead = tmp_path / "dead.yaml"
    dead.write_text(f"backends: [{{id: a, address: 127.0.0.1:{free_port()}}}]\n")
    assert main(["check", "--config", str(dead), "--timeout-s", "0.5", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == 1 and "connection refused" in doc["problems"][0]["what"]


async def test_kv_events_in_bind_mode_wait_for_the_engine_to_connect(engines: Start) -> None:
    """With mode bind the router binds and the engine connects: the check binds the
    address as the router would and takes the engine's handshake; an address no engine
    connects to is a problem whose fix is the engine's endpoint."""
    port, lonely = free_port(), free_port()
    srv = await engines(kv_events=KvEventsConfig(endpoint=f"tcp://127.0.0.1:{port}"))
    bound = {"endpoint": f"tcp://127.0.0.1:{port}", "mode": "bind"}
    nobody = {"endpoint": f"tcp://127.0.0.1:{lonely}", "mode": "bind"}
    verdict, _ = await check(
        {"backends": [backend(srv, "a", kv_events=bound), backend(srv, "b", kv_events=nobody)]}
    )
    (problem,) = verdict.problems
    assert problem.line() == (
        f"backend b: KV events: no engine connected to tcp://127.0.0.1:{lonely} within "
        f'{TIMEOUT_S:g} s. Fix: start the engine with --kv-events-config \'{{"publisher": '
        f'"zmq", "endpoint": "tcp://ROUTER_HOST:{lonely}"}}\' (with mode bind it connects '
        "to the router), or correct backends[1].kv_events.endpoint"
    )
    assert [b.prefix.precise for b in verdict.backends] == [True, False]
