"""The admin API fuzzed from its own OpenAPI document (issue 51): schemathesis with every
check (`--checks all`) against a running router's admin port, with no token configured,
and with one configured, sent and not sent. No 500, every answer as the document says
(status, content type, body, headers), a method a path does not serve answered 405 with
Allow, and without the token no change at all: the fleet and the tuner before and after
the run are the same, and every change schemathesis sent was refused.

The runs are short here (a bounded number of examples per operation, seconds each); the
long tier runs more (`-m long`). Allowances per operation, each with its reason:
admin_schemathesis.toml; bodies not sent (a bind to an arbitrary port):
admin_schemathesis_hooks.py."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest

from ext_proc.config.load import config_from_dict
from ext_proc.service.admin.openapi import admin_openapi
from ext_proc.service.app import Running, running_service
from ext_proc.vocab.types import Status
from tests.builders import chat

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
SETTINGS = HERE / "admin_schemathesis.toml"
HOOKS = "tests.component.admin_schemathesis_hooks"
TOKEN = "fuzz-token-0123456789"
# Examples per operation and phase: ~400 requests in all, a few seconds per run (fixed
# seed); the long tier's runs ~2,500-4,000 requests each, on a new seed each time (its
# output names it: `--seed N` replays a failure).
SHORT_EXAMPLES = 10
LONG_EXAMPLES = 300
SEED = 51
# Every operation many times (the short runs send ~450 requests).
MIN_REQUESTS = 300
# A run that takes longer is stuck (the short runs take ~5 s; the long ones ~1-2 min).
RUN_TIMEOUT_S = 600.0
CHANGES = {"POST", "PUT", "PATCH", "DELETE"}
# Decisions made before the run, so /state, /ui/feed and /ui/decision answer with rows.
DECISIONS = 5


def config(token: str) -> Any:
    listen = {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0", "admin_token": token}
    return config_from_dict(
        {
            "policy": "gorgo",
            "listen": listen,
            # Fakes nothing answers: probes fail, so /readyz says not ready (503).
            "backends": [
                {"id": "a", "address": "127.0.0.1:1"},
                {"id": "b", "address": "127.0.0.1:2"},
            ],
            "tuner": {"mode": "paired"},
        }
    )


async def schemathesis(
    port: int, tmp: Path, examples: int, headers: dict[str, str], seed: int | None
) -> tuple[int, str, list[dict[str, Any]]]:
    """Run schemathesis's CLI against the admin's own document: its exit code, output and
    the requests it sent (HAR entries)."""
    har = tmp / "requests.har"
    args = [
        str(SCHEMATHESIS),
        "--no-color",
        "--config-file",
        str(SETTINGS),
        "run",
        f"http://127.0.0.1:{port}/openapi.json",
        "--checks",
        "all",
        "--max-examples",
        str(examples),
        *(["--seed", str(seed)] if seed is not None else []),
        "--report",
        "har",
        "--report-har-path",
        str(har),
        # The test's token in the HAR (it is no secret), to tell who sent it.
        "--output-sanitize",
        "false",
    ]
    for name, value in headers.items():
        args += ["-H", f"{name}: {value}"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": HOOKS, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        *args,
        cwd=tmp,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    entries = json.loads(har.read_text())["log"]["entries"] if har.exists() else []
    return int(proc.returncode or 0), out.decode(errors="replace"), entries


async def fleet_and_tuner(svc: Running) -> dict[str, Any]:
    """What a change could move: the fleet (through the API and the router's own view),
    the removed backends, and the tuner."""
    url = f"http://127.0.0.1:{svc.admin_port}"
    async with aiohttp.ClientSession() as s, s.get(f"{url}/backends") as r:
        assert r.status == 200
        listed = await r.json()
    tuner = svc.router.tuner
    assert tuner is not None
    snap = tuner.snapshot()
    return {
        "backends": [(b["id"], b["lifecycle"], b["config"]) for b in listed["backends"]],
        "removed": [r.get("id") for r in listed["removed"]],
        "router": sorted(svc.router.backends),
        "tuner": (snap["frozen"], snap["weights"]),
    }


def statuses(entries: list[dict[str, Any]], methods: set[str]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for e in entries:
        if e["request"]["method"] in methods:
            status = int(e["response"]["status"])
            counts[status] = counts.get(status, 0) + 1
    return counts


async def answers_with_rows_match(svc: Running, token: bool) -> None:
    """The answers schemathesis rarely reaches with rows in them (a decision's id it cannot
    guess), checked against the document's schemas too."""
    doc = admin_openapi(token)
    url = f"http://127.0.0.1:{svc.admin_port}"
    reads = {
        "/state": "State",
        "/backends": "Fleet",
        "/ui/feed?since=0": "Feed",
        "/ui/decision?request_id=fuzz-0": "Decision",
    }
    async with aiohttp.ClientSession() as s:
        for path, name in reads.items():
            async with s.get(url + path) as r:
                assert r.status == 200, path
                body = await r.json()
            schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
            jsonschema.validate(body, schema, cls=jsonschema.Draft202012Validator)
            if name in ("State", "Feed"):
                rows = body["recent_decisions"] if name == "State" else body["decisions"]
                assert len(rows) >= DECISIONS, path


async def fuzz(token: str, send_token: bool, examples: int, tmp: Path) -> dict[str, Any]:
    """One run against a fresh router with a few decisions made; what it sent and what it
    changed."""
    headers = {"Authorization": f"Bearer {token}"} if send_token else {}
    async with running_service(config(token)) as svc:
        ids = [f"fuzz-{i}" for i in range(DECISIONS)]
        for rid in ids:
            svc.router.decide(chat(rid=rid))
        for rid in ids[:3]:  # completed; the others stay in flight through the run
            svc.router.first_byte(rid)
            svc.router.close(rid, Status.OK)
        before = await fleet_and_tuner(svc)
        seed = SEED if examples == SHORT_EXAMPLES else None
        code, out, entries = await schemathesis(svc.admin_port, tmp, examples, headers, seed)
        after = await fleet_and_tuner(svc)
        await answers_with_rows_match(svc, bool(token))
        for rid in ids[3:]:  # (else the service's stop waits for them)
            svc.router.close(rid, Status.OK)
    assert code == 0, out[-6000:]
    assert len(entries) >= MIN_REQUESTS, out[-3000:]
    print(f"\n{len(entries)} requests; changes: {statuses(entries, CHANGES)}")
    return {"before": before, "after": after, "entries": entries, "out": out}


async def check_without_the_token(examples: int, tmp: Path) -> None:
    run = await fuzz(TOKEN, False, examples, tmp)
    assert run["after"] == run["before"]  # nothing changed
    changes = statuses(run["entries"], CHANGES)
    # Every change refused (401), or not routed at all (404, 405): none reached a handler.
    assert set(changes) <= {401, 404, 405}, changes
    assert changes.get(401, 0) >= examples, changes
    assert changes.get(405, 0) >= 1, changes  # methods the document does not list


@pytest.mark.long  # 10 s; `make test` keeps the token's two runs (its long twin: below)
async def test_schemathesis_with_no_token_configured(tmp_path: Path) -> None:
    run = await fuzz("", False, SHORT_EXAMPLES, tmp_path)
    changes = statuses(run["entries"], CHANGES)
    assert changes.get(405, 0) >= 1 and 500 not in changes, changes


def authorization(entry: dict[str, Any]) -> str | None:
    for h in entry["request"]["headers"]:
        if h["name"].lower() == "authorization":
            return str(h["value"])
    return None


async def test_schemathesis_with_the_token(tmp_path: Path) -> None:
    run = await fuzz(TOKEN, True, SHORT_EXAMPLES, tmp_path)
    changes = [e for e in run["entries"] if e["request"]["method"] in CHANGES]
    with_it = [e for e in changes if authorization(e) == f"Bearer {TOKEN}"]
    without = [e for e in changes if authorization(e) != f"Bearer {TOKEN}"]
    ok = statuses(with_it, CHANGES)
    # With the token, changes reach the handlers (some applied, none refused 401); the
    # few schemathesis sends without it or with another (its auth checks) are refused.
    assert 401 not in ok and any(200 <= s < 300 for s in ok), ok
    assert without and set(statuses(without, CHANGES)) <= {401, 404, 405}


async def test_schemathesis_without_the_token_changes_nothing(tmp_path: Path) -> None:
    await check_without_the_token(SHORT_EXAMPLES, tmp_path)


@pytest.mark.long
@pytest.mark.parametrize(("token", "send"), [("", False), (TOKEN, True), (TOKEN, False)])
async def test_schemathesis_long(token: str, send: bool, tmp_path: Path) -> None:
    if token and not send:
        await check_without_the_token(LONG_EXAMPLES, tmp_path)
    else:
        await fuzz(token, send, LONG_EXAMPLES, tmp_path)
