"""Routing by the request's model through real Envoy and one `gorgo serve` (issue 28,
done-when 1 and 2), with emulated vLLM engines and a router config that lists only the
backends, as a user's would: what each engine serves is read from its `/v1/models`.

- Two engines serve `alpha`, one `beta`: `beta` goes only to its backend, `alpha` never
  there; an unknown model (404), no model (400) and a model whose only backend is ejected
  or draining (503 with Retry-After) are answered by the router, no engine reached;
  /state lists each backend's models and `GET /v1/models` at the front door the fleet's.
- A LoRA adapter loaded on one engine at run time is routed to within one models read
  (`probes.models_interval_s`), and once unloaded its backend stops getting it, while 16
  clients stream the base model throughout without a failure.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import pytest

from emulator.stack.stack import Stack
from ext_proc.common.names import HEADER_BACKEND
from ext_proc.vocab.errors import MODEL_NOT_FOUND, MODEL_REQUIRED, UNAVAILABLE, ApiError
from loadgen.client.stream import Result, chat_body, send_chat
from tests.e2e.conftest import FAST_ENGINE, FAST_REGIONS, fast_settings
from tests.e2e.stack_harness import admin_call, get_json, router_state, wait_for

# Long (5 s and more a test): `make test-long`, which CI runs after `make test`.
pytestmark = [pytest.mark.e2e, pytest.mark.long]

ASHBURN, FRANKFURT, SEOUL = (r.id for r in FAST_REGIONS)
# Streams of TOKENS tokens at 15 ms each: a drain or an unload finds requests in flight.
SLOW_DECODE = (*FAST_ENGINE, "--set", "decode_base_ms=15")
TOKENS = 20
MODELS_INTERVAL_S = 0.5
# A busy machine (two cores, other tests beside) delays a read or a decision this much.
SLACK_S = 1.0
# The longest a request takes from its send to the engine here (Envoy, the router's
# decision, the WAN link), with room for a busy machine.
TRIP_S = 0.25


def models_stack(engine_models: dict[str, str], *engine_args: str, eject_s: float = 5.0) -> Stack:
    """Emulated vLLM engines serving the models named; the router's config has only the
    backends (no `models:`), and reads each engine's models every MODELS_INTERVAL_S."""
    settings = fast_settings(
        "round_robin",  # every candidate in turn: a backend left out is plainly left out
        engine_args=(*SLOW_DECODE, *engine_args),
        flavor="vllm",
        engine_models=engine_models,
        probe_interval_s=0.5,
    )
    stack = Stack(settings)
    cfg = stack.config
    assert all(not b.models for b in cfg.backends)  # discovered, not configured
    stack.config = replace(
        cfg,
        probes=replace(cfg.probes, models_interval_s=MODELS_INTERVAL_S),
        routing=replace(cfg.routing, eject_s=eject_s),
    )
    return stack


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: Any

    @property
    def backend(self) -> str:
        return self.headers.get(HEADER_BACKEND, "")

    @property
    def error(self) -> dict[str, Any]:
        err = self.body.get("error") if isinstance(self.body, dict) else None
        return err if isinstance(err, dict) else {}

    @property
    def message(self) -> str:
        err = self.body.get("error") if isinstance(self.body, dict) else None
        return str(err.get("message", "")) if isinstance(err, dict) else ""


def call(url: str, body: Any = None, method: str | None = None) -> Answer:
    req = urllib.request.Request(
        url,
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=15) as r:
            status, headers, raw = r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        status, headers, raw = e.code, e.headers, e.read()
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = raw.decode()
    return Answer(status, {k.lower(): v for k, v in headers.items()}, doc)


def ask(stack: Stack, model: str | None, tokens: int = 2) -> Answer:
    """One chat request through the front door, not streamed; `model` None: none named."""
    body = chat_body("which model?", tokens, stream=False)
    if model is None:
        del body["model"]
    else:
        body["model"] = model
    return call(f"{stack.front_door_url}/v1/chat/completions", body)


def engine_counts(stack: Stack) -> dict[str, int]:
    """Generation requests each engine received (its /stats; reads of /v1/models and
    probes are not counted)."""
    return {
        r.id: get_json(f"{stack.engine_url(i)}/stats")["requests_total"]
        for i, r in enumerate(FAST_REGIONS)
    }


def models_of(stack: Stack) -> dict[str, Any]:
    return {b: s["models"] for b, s in router_state(stack)["backends"].items()}


def front_door_models(stack: Stack) -> Answer:
    return call(f"{stack.front_door_url}/v1/models")


def assert_router_answered(a: Answer, error: ApiError) -> None:
    """An answer of the router's own (no engine reached): its status and OpenAI error
    (type, code, param), and no backend named (Envoy's x-gorgo-backend is set only on a
    routed request; the engine's errors say NotFoundError, BadRequestError...)."""
    got = (a.status, a.error.get("type"), a.error.get("code"), a.error.get("param"))
    assert got == (error.status, error.type, error.code, error.param), (a.status, a.body)
    assert a.backend == "" and "x-engine-id" not in a.headers, a.headers


async def streams(url: str, models: list[str]) -> list[Result]:
    async with aiohttp.ClientSession() as http:
        return list(
            await asyncio.gather(
                *(
                    send_chat(http, url, chat_body(f"q{i} {m} " * 8, TOKENS, model=m), f"{m}{i}")
                    for i, m in enumerate(models)
                )
            )
        )


def test_each_model_goes_where_it_is_served_and_the_rest_are_answered() -> None:
    """Done-when 1. No wait after the stack is up: the router has read every engine's
    models when it first answers /healthz, so the very first requests are routed by
    model (before, the first ones went to any backend, and beta's engine-side 404s)."""
    stack = models_stack({ASHBURN: "alpha", FRANKFURT: "alpha", SEOUL: "beta"}, eject_s=2.0)
    stack.start()
    try:
        before = engine_counts(stack)
        # the first requests, at once
        results = asyncio.run(streams(stack.front_door_url, ["beta", "alpha"] * 12))
        assert all(r.ok and r.output_tokens == TOKENS for r in results), [
            r.error for r in results if not r.ok
        ][:3]
        served: dict[str, set[str]] = {"alpha": set(), "beta": set()}
        for r in results:
            served[r.id.rstrip("0123456789")].add(r.backend)
        assert served == {"alpha": {ASHBURN, FRANKFURT}, "beta": {SEOUL}}
        after = engine_counts(stack)
        assert after[SEOUL] - before[SEOUL] == 12
        assert sum(after.values()) - sum(before.values()) == 24

        # /state names each backend's models, and the front door lists the fleet's
        models = models_of(stack)
        assert {b: m["base"] for b, m in models.items()} == {
            ASHBURN: ["alpha"],
            FRANKFURT: ["alpha"],
            SEOUL: ["beta"],
        }
        listed = front_door_models(stack)
        assert listed.status == 200 and listed.backend == ""  # the router's answer
        assert [m["id"] for m in listed.body["data"]] == ["alpha", "beta"]

        # unknown and missing models: answered by the router, no engine reached
        counts = engine_counts(stack)
        unknown = ask(stack, "gamma")
        assert_router_answered(unknown, MODEL_NOT_FOUND)
        assert "'gamma'" in unknown.message and "/v1/models" in unknown.message
        missing = ask(stack, None)
        assert_router_answered(missing, MODEL_REQUIRED)
        assert "alpha, beta" in missing.message
        assert engine_counts(stack) == counts

        # beta's only backend ejected (its engine fails two requests in a row): 503
        call(f"{stack.engine_url(2)}/faults", {"error_rate": 1.0})
        failing = [ask(stack, "beta") for _ in range(2)]
        assert [(a.status, a.backend) for a in failing] == [(500, SEOUL)] * 2  # the engine's
        call(f"{stack.engine_url(2)}/faults", {"error_rate": 0.0})
        # The failures' reports (the observer's first chunk, the access log) travel on
        # streams of their own, sent before the client reads the 500: a client's next
        # request can still overtake them by a few ms (seen on CI), so the ejection is
        # waited for, within a second.
        wait_for(lambda: router_state(stack)["backends"][SEOUL]["ejected"], 1.0)
        counts = engine_counts(stack)
        t_ejected = time.monotonic()
        ejected = ask(stack, "beta")
        assert_router_answered(ejected, UNAVAILABLE)
        assert "'beta'" in ejected.message
        assert 1 <= int(ejected.headers["retry-after"]) <= 2  # the ejection's end (eject_s)
        # the same wait to the millisecond, which the whole seconds round up
        wait_ms = int(ejected.headers["retry-after-ms"])
        assert 0 < wait_ms <= 2000 and -(-wait_ms // 1000) == int(ejected.headers["retry-after"])
        assert ask(stack, "alpha").status == 200  # alpha is not held up by it
        assert engine_counts(stack)[SEOUL] == counts[SEOUL]
        # back in rotation when the ejection ends, as Retry-After said
        time.sleep(max(0.0, t_ejected + 2.1 - time.monotonic()))
        back = ask(stack, "beta")
        assert (back.status, back.backend) == (200, SEOUL)

        # beta's only backend draining (a stream still on it): 503, then removed: 404
        deadline = time.monotonic() + 5
        # the last request's completion first (Envoy batches its access-log entries, up
        # to 50 ms): in flight then means the long stream
        while router_state(stack)["backends"][SEOUL]["in_flight"] != 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        long = threading.Thread(target=ask, args=(stack, "beta", 150))  # ~2.3 s of decode
        long.start()
        while router_state(stack)["backends"][SEOUL]["in_flight"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        status, drained = admin_call(stack, "POST", f"/backends/{SEOUL}/drain")
        assert status == 202 and drained["lifecycle"] == "draining"
        counts = engine_counts(stack)
        draining = ask(stack, "beta")
        assert_router_answered(draining, UNAVAILABLE)
        assert int(draining.headers["retry-after"]) >= 1
        assert engine_counts(stack)[SEOUL] == counts[SEOUL]
        long.join(timeout=15)
        deadline = time.monotonic() + 10
        while SEOUL in router_state(stack)["backends"]:
            assert time.monotonic() < deadline, "drained backend not removed"
            time.sleep(0.05)
        # no backend serves beta any more: unknown, and gone from the fleet's list
        assert_router_answered(ask(stack, "beta"), MODEL_NOT_FOUND)
        assert [m["id"] for m in front_door_models(stack).body["data"]] == ["alpha"]
        assert engine_counts(stack)[SEOUL] == counts[SEOUL]
        print(
            f"\nfirst requests: alpha on {sorted(served['alpha'])}, beta on "
            f"{sorted(served['beta'])}; refusals 404/400/503 (ejected, Retry-After "
            f"{ejected.headers['retry-after']} s; draining, Retry-After "
            f"{draining.headers['retry-after']} s) with no engine reached"
        )
    finally:
        stack.stop()


@dataclass
class Clients:
    """`n` closed-loop clients streaming `model` through the front door, in a thread of
    their own until stopped; each result with the moment it was sent."""

    url: str
    model: str
    n: int
    sent: list[tuple[float, Result]] = field(default_factory=list)
    stopping: bool = False
    thread: threading.Thread | None = None

    async def client(self, http: aiohttp.ClientSession, c: int) -> None:
        i = 0
        while not self.stopping:
            t = time.monotonic()
            body = chat_body(f"{self.model} c{c} r{i} " * 8, TOKENS, model=self.model)
            r = await send_chat(http, self.url, body, f"{self.model}-{c}-{i}")
            self.sent.append((t, r))
            i += 1
            if not r.ok:
                await asyncio.sleep(0.02)  # a refusal is immediate: do not spin on it

    async def clients(self) -> None:
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(self.client(http, c) for c in range(self.n)))

    def start(self) -> Clients:
        self.thread = threading.Thread(target=asyncio.run, args=(self.clients(),))
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping = True
        if self.thread is not None:
            self.thread.join(timeout=30)

    def results(self) -> list[tuple[float, Result]]:
        return list(self.sent)


def until(predicate: Any, timeout_s: float, what: str) -> float:
    """Poll until true; returns the moment it became true."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not reached in {timeout_s} s: {what}"
        time.sleep(0.01)
    return time.monotonic()


def test_an_adapter_loaded_at_run_time_is_routed_to_and_unloaded_is_not() -> None:
    """Done-when 2. Three engines serve `alpha` with LoRA enabled; 16 clients stream
    `alpha` throughout. `sql` is loaded on us-ashburn's engine directly (as an operator
    would, `POST /v1/load_lora_adapter`): the router learns it at its next read of that
    engine's /v1/models, within one `probes.models_interval_s` (0.5 s here), and sends
    it only there. Then it is unloaded there.

    What is honest to expect, and asserted:
    - `alpha`'s 16 clients never fail, before, during or after either change;
    - a request for `sql` before the router has read it is refused by the router (404,
      no engine reached: no engine is known to serve it), so its clients start once it is
      routed (a single caller polls until then, timing the latency);
    - from the load, every request for `sql` that is routed goes to us-ashburn;
    - after the unload, until the router's next read (at most one interval), a request
      for `sql` may still be sent to us-ashburn, whose engine answers 404 itself (vLLM's
      NotFoundError): the router cannot know before it reads (nor can a request sent just
      before the unload call, TRIP_S, that reaches the engine after it). Those sent after the read
      are the router's own 404 naming it; no `sql` request reaches an engine again. The
      streams already running on the adapter when it is unloaded finish (the engine
      keeps them, as vLLM does).
    """
    stack = models_stack(
        {ASHBURN: "alpha", FRANKFURT: "alpha", SEOUL: "alpha"}, "--enable-lora", "--max-loras", "2"
    )
    stack.start()
    base = Clients(stack.front_door_url, "alpha", 16)
    adapter = Clients(stack.front_door_url, "sql", 4)
    figures: dict[str, float] = {}
    try:
        assert_router_answered(ask(stack, "sql"), MODEL_NOT_FOUND)
        base.start()
        time.sleep(1.0)

        # (1) load it on ashburn's engine; poll a request for it until one is routed
        t_load = time.monotonic()
        loaded = call(
            f"{stack.engine_url(0)}/v1/load_lora_adapter",
            {"lora_name": "sql", "lora_path": "/lora/sql"},
        )
        assert loaded.status == 200, loaded.body
        polls: list[Answer] = []
        while True:
            a = ask(stack, "sql", tokens=1)
            if a.status == 200:
                break
            polls.append(a)
            assert time.monotonic() < t_load + MODELS_INTERVAL_S + 5, "sql never routed"
        t_routed = time.monotonic()
        figures["load_to_first_routed_s"] = t_routed - t_load
        assert a.backend == ASHBURN
        for p in polls:  # refused by the router meanwhile, never by an engine
            assert_router_answered(p, MODEL_NOT_FOUND)
        assert models_of(stack)[ASHBURN]["adapters"] == {"sql": "alpha"}
        assert {m["id"]: m["parent"] for m in front_door_models(stack).body["data"]} == {
            "alpha": None,
            "sql": "alpha",
        }

        # (2) its clients stream it: only ashburn gets it
        adapter.start()
        time.sleep(2.0)

        # (3) unload it there: the router's next read forgets it
        t_unload = time.monotonic()
        unloaded = call(f"{stack.engine_url(0)}/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert unloaded.status == 200, unloaded.body
        t_forgot = until(
            lambda: models_of(stack)[ASHBURN]["adapters"] == {},
            MODELS_INTERVAL_S + 5,
            "the router reads that sql is gone",
        )
        figures["unload_to_forgotten_s"] = t_forgot - t_unload
        time.sleep(1.0)
        adapter.stop()
        time.sleep(0.5)
        base.stop()
        t_end = time.monotonic()
        counts_end = engine_counts(stack)
        assert_router_answered(ask(stack, "sql"), MODEL_NOT_FOUND)
        assert engine_counts(stack) == counts_end
    finally:
        adapter.stop()
        base.stop()
        stack.stop()

    base_results = base.results()
    base_failed = [r for _, r in base_results if not r.ok or r.output_tokens != TOKENS]
    by_backend: dict[str, int] = {}
    for _, r in base_results:
        by_backend[r.backend] = by_backend.get(r.backend, 0) + 1
    sql = adapter.results()
    # a request sent just before the unload call may reach the engine after it (through
    # Envoy, the router and the WAN link, on a busy machine): those are the window's too
    t_window = t_unload - TRIP_S
    before_unload = [r for t, r in sql if t < t_window]
    # sent after the unload, before the router's read could have taken effect
    window = [r for t, r in sql if t_window <= t < t_forgot]
    after_read = [r for t, r in sql if t >= t_forgot + 0.05]
    engine_404 = [r for _, r in sql if r.status == 404 and r.backend]
    router_404 = [r for _, r in sql if r.status == 404 and not r.backend]
    print(
        f"\nalpha: {len(base_results)} streams, {len(base_failed)} failed, served {by_backend}; "
        f"sql: {len(polls)} polls refused before routed, {len(before_unload)} streams before "
        f"the unload, {len(window)} in the read's window ({len(engine_404)} engine 404s), "
        f"{len(after_read)} after ({len(router_404)} router 404s); "
        + ", ".join(f"{k} {v:.3f}" for k, v in figures.items())
    )
    assert base_failed == [], [r.error for r in base_failed][:5]
    assert set(by_backend) == {ASHBURN, FRANKFURT, SEOUL}  # base on every engine throughout
    assert figures["load_to_first_routed_s"] <= MODELS_INTERVAL_S + SLACK_S
    assert figures["unload_to_forgotten_s"] <= MODELS_INTERVAL_S + SLACK_S
    # while loaded: every sql stream ok, and all on ashburn (its only engine)
    assert len(before_unload) >= 8
    assert all(r.ok and r.output_tokens == TOKENS for r in before_unload), [
        r.error for r in before_unload if not r.ok
    ][:3]
    assert {r.backend for r in before_unload} == {ASHBURN}
    # after the unload: never another engine; ashburn's own 404 only in the read's window
    for t, r in sql:
        if t >= t_window:
            assert r.backend in ("", ASHBURN), r
            assert r.ok or r.status == 404, r.error
            if r.status == 404 and r.backend:
                assert t < t_forgot, (t - t_unload, r.error)
                assert "NotFoundError" in r.error
    assert len(after_read) >= 4
    assert all(r.status == 404 and not r.backend for r in after_read)
    assert all("model_not_found" in r.error for r in after_read)
    assert t_end > t_forgot


def test_an_alias_is_sent_on_as_its_served_names_with_the_body_rewritten() -> None:
    """Aliases (config `models[]`): a public name split over two served ones; Envoy takes
    the router's body mutation (the body's `model` and its content-length), so each
    engine gets a request for a name it serves, and a session keeps its share."""
    from ext_proc.config.schema import ModelAlias, ServedShare

    stack = models_stack({ASHBURN: "alpha", FRANKFURT: "alpha", SEOUL: "beta"})
    split = ModelAlias("chat", (ServedShare("alpha", 1.0), ServedShare("beta", 1.0)))
    stack.config = replace(stack.config, models=(split,))
    stack.start()
    try:
        by_session: dict[str, set[str]] = {}
        for i in range(40):
            session = f"s{i % 10}"
            body = chat_body(f"turn {i} of {session}", 2, stream=False)
            body["model"], body["user"] = "chat", session
            a = call(f"{stack.front_door_url}/v1/chat/completions", body)
            assert a.status == 200, (a.status, a.body)
            served = {ASHBURN: "alpha", FRANKFURT: "alpha", SEOUL: "beta"}[a.backend]
            assert a.body["model"] == served  # the engine answered for the served name
            by_session.setdefault(session, set()).add(served)
        assert all(len(v) == 1 for v in by_session.values())  # a session keeps its share
        assert {m for v in by_session.values() for m in v} == {"alpha", "beta"}
        listed = [m["id"] for m in front_door_models(stack).body["data"]]
        assert listed == ["alpha", "beta", "chat"]
    finally:
        stack.stop()
