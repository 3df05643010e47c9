"""The operator's page on the admin port: GET /ui (HTML, CSS and JavaScript shipped in
ext_proc/service/admin/page/, nothing fetched from elsewhere) and the compact JSON it polls.

GET /ui/feed?since=SEQ&steps=KEY answers what changed since the page's last poll: the
fleet (a row per backend, ~64 rows at most in practice), the decisions made or closed
after SEQ (each with its best candidates' cost terms), and the tuner's path when it moved.
GET /ui/decision?request_id=X answers one decision with every candidate. Both read only
what the router holds already (the bounded decision log, /state's per-backend figures),
and build it between requests, in chunks (gorgo bench page measures it)."""

from __future__ import annotations

import asyncio
import functools
import heapq
import math
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any

import orjson
from aiohttp import web

from ext_proc.core.decision_log import Entry
from ext_proc.core.router import Router
from ext_proc.core.terms.catalog import TERMS
from ext_proc.vocab.types import Weights

TermWeights = Callable[[Weights], Mapping[str, float]]

# Candidates per decision in the feed (the chosen one first, then the best scores): the
# table's bars. The decision's own endpoint has them all.
FEED_CANDIDATES = 4
# Decision rows built per turn of the event loop (~3.5 ms at 64 backends): a page's first
# poll of 1,000 decisions never holds the router's requests for its whole ~35 ms.
ROWS_PER_TURN = 100
ASSETS = {
    "page.js": "text/javascript",
    "page.css": "text/css",
}


@functools.cache
def _asset(name: str) -> bytes:
    return resources.files("ext_proc.service.admin").joinpath("page", name).read_bytes()


def prefix_why(b: dict[str, Any]) -> str:
    """Why the backend's cached-token predictions come from where they do (/state's row)."""
    state = b["prefix_state"]
    kv = b.get("kv_events")
    tokens = b.get("tokens") or {}
    if state == "precise":
        return "the engine's KV events"
    if state == "warming":
        return "KV events up; warming until predictions match the engine's reports"
    if kv is None:
        return "no KV events configured: the router's own index"
    if kv.get("unsupported"):
        return f"KV events unusable: {kv['unsupported']}"
    if not tokens.get("ok", True):
        return f"token ids differ from the engine's: {tokens.get('reason', '')}"
    if not kv["up"]:
        return "KV-event stream down: the router's own index"
    return "the router's own index"


def backend_rows(router: Router, state: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for bid, b in state["backends"].items():
        held = router.backends.get(bid)
        ttft = b["latency_prediction"]["ttft"]
        models = b["models"]
        rows.append(
            {
                "id": bid,
                "region": "" if held is None else held.config.region,
                "lifecycle": b["lifecycle"],
                "suspect": b["suspect"],
                "ejected": b["ejected"],
                "rtt_ms": b["rtt_ms"],
                "rtt_std_ms": b["rtt_std_ms"],
                "queue_ms": b["queue_ms"],
                "in_flight": b["in_flight"],
                "completed": b["completed"],
                "errors": b["errors"],
                "engine": b["engine"],
                "prefix_state": b["prefix_state"],
                "prefix_why": prefix_why(b),
                "ttft_mape": ttft["mape"],
                "ttft_bias_ms": ttft["bias_ms"],
                # routing.ttft_model: replay: the step model in use ("fit" or "profile")
                # and why (None: the replay is not in use there)
                "step_model": None if b["step_model"] is None else b["step_model"]["using"],
                "step_model_why": None if b["step_model"] is None else b["step_model"]["why"],
                "models": None
                if models is None
                else [*models["base"], *sorted(models.get("adapters") or {})],
            }
        )
    return rows


def shown_terms() -> list[str]:
    """The cost terms the page draws, in their order (every registered cost)."""
    return [name for name, info in TERMS.items() if info.cost]


def terms_json() -> list[dict[str, str]]:
    """The terms a feed's candidate rows carry, with their labels (the page's columns)."""
    return [{"name": n, "label": TERMS[n].label, "unit": TERMS[n].unit} for n in shown_terms()]


def _candidate(entry: Entry, c: Any, names: list[str]) -> list[Any]:
    score = entry.decision.scores.get(c.backend_id)
    return [
        c.backend_id,
        None if score is None else round(score, 3),
        c.cached_tokens,
        c.uncached_tokens,
        *(round(c.term(n), 2) for n in names),
    ]


def _aligned(weights: Mapping[str, float], names: list[str]) -> list[float]:
    return [round(weights.get(n, 0.0), 4) for n in names]


def entry_row(
    entry: Entry, term_weights: TermWeights | None = None, every_candidate: bool = False
) -> dict[str, Any]:
    """One decision, compact: candidates as [backend, score, cached tokens, uncached
    tokens, then each shown term's value (shown_terms)]; `term_weights`: the policy's,
    when its score is the weighted sum of the terms."""
    d = entry.decision
    chosen = d.chosen
    others = [c for c in d.candidates if c.backend_id != d.backend]
    best = d.scores.get
    if every_candidate:
        others.sort(key=lambda c: best(c.backend_id, math.inf))
    else:
        others = heapq.nsmallest(
            FEED_CANDIDATES - 1, others, lambda c: best(c.backend_id, math.inf)
        )
    shown = [chosen, *others]
    names = shown_terms()
    return {
        "n": entry.number,
        "seq": entry.seq,
        "id": d.request_id,
        "at_s": round(entry.at_s, 3),
        "model": d.model,
        "tokens": d.input_tokens,
        "backend": d.backend,
        "policy": d.policy,
        "hold_ms": round(d.pace_ms, 2),
        # a disaggregated decision's prefill engine, its KV and the predicted transfer
        "prefill": None if d.prefill is None else d.prefill.as_json(),
        "candidates": [_candidate(entry, c, names) for c in shown],
        "of": len(d.candidates),
        "predicted": [round(chosen.predicted_ttft_ms, 2), round(chosen.predicted_e2e_ms, 2)],
        "observed": entry.observed,
        "trace_id": entry.trace_id,
        # Each shown term's multiplier in the score (None: the score is not their sum).
        "term_weights": None
        if term_weights is None or d.weights is None
        else _aligned(term_weights(d.weights), names),
    }


def term_weights_of(router: Router) -> TermWeights | None:
    """The policy's term weights (Gorgo.term_weights), if its score is their sum."""
    f: TermWeights | None = getattr(router.policy, "term_weights", None)
    return f


def _steps_key(history: list[dict[str, Any]]) -> str:
    return f"{len(history)}:{history[-1]['samples'] if history else 0}"


def feed(
    router: Router,
    since: int,
    steps_key: str,
    trace_url: str,
    decisions: bool = True,
    flow: Callable[[], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The page's poll; `decisions=False` leaves their rows for the caller to build;
    `flow`: the gateway queue's snapshot (director.admission: Admission.snapshot)."""
    state = router.snapshot(decisions=False)
    log = router.recent
    tuner = router.tuner
    tuner_json = None
    if tuner is not None:
        history = tuner.state.history
        key = _steps_key(history)
        tuner_json = {
            **{k: v for k, v in tuner.snapshot().items() if k != "recent_steps"},
            "steps_key": key,
            # The whole path (<= 500 steps) only when it moved since the page's last poll.
            "steps": None if key == steps_key else history,
        }
    return {
        "seq": log.seq,
        "now_s": round(router.clock(), 3),
        "log_size": log.size,
        "policy": state["policy"],
        "weights": state["weights"],
        "decisions_total": state["decisions"],
        "in_flight": state["in_flight"],
        "trace_url": trace_url,
        # What each candidate row carries after its four first fields.
        "terms": terms_json(),
        "backends": backend_rows(router, state),
        "tuner": tuner_json,
        # The gateway queue: what waits, by band and tenant, and what it did.
        "flow": flow() if flow is not None else {"enabled": False},
        "decisions": [entry_row(e, term_weights_of(router)) for e in log.changed_since(since)]
        if decisions
        else [],
    }


def add_page_routes(
    app: web.Application,
    router: Router,
    trace_url: str,
    flow: Callable[[], dict[str, Any]] | None = None,
) -> None:
    async def page(_: web.Request) -> web.Response:
        return web.Response(body=_asset("index.html"), content_type="text/html", charset="utf-8")

    async def asset(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in ASSETS:
            why = f"no asset {name!r}; the page has {', '.join(ASSETS)}"
            return web.json_response({"error": why}, status=404)
        return web.Response(body=_asset(name), content_type=ASSETS[name], charset="utf-8")

    async def feed_handler(request: web.Request) -> web.Response:
        raw = request.query.get("since", "0")
        if not (raw.isascii() and raw.isdigit()):  # "²" is a digit int() refuses
            why = f"since: expected an integer >= 0, got {raw!r}"
            return web.json_response({"error": why}, status=400)
        since = int(raw)
        steps = request.query.get("steps", "")
        body = feed(router, since, steps, trace_url, decisions=False, flow=flow)
        entries = router.recent.changed_since(since)
        weights = term_weights_of(router)
        rows = body["decisions"]
        for i in range(0, len(entries), ROWS_PER_TURN):
            if i:
                await asyncio.sleep(0)  # a page's first poll: requests go between chunks
            rows += [entry_row(e, weights) for e in entries[i : i + ROWS_PER_TURN]]
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def decision(request: web.Request) -> web.Response:
        rid = request.query.get("request_id", "")
        entry = router.recent.find(rid) if rid else None
        if entry is None:
            why = "request_id: required" if not rid else f"no recent decision for {rid!r}"
            return web.json_response({"error": why}, status=404 if rid else 400)
        row = {**entry_row(entry, term_weights_of(router), every_candidate=True)}
        row["terms"] = terms_json()
        return web.Response(body=orjson.dumps(row), content_type="application/json")

    app.router.add_get("/ui", page)
    app.router.add_get("/ui/feed", feed_handler)
    app.router.add_get("/ui/decision", decision)
    app.router.add_get("/ui/{name}", asset)
