"""The admin port's OpenAPI document (ext_proc/service/admin/openapi.py) against the app:
every route of the app is in it and every operation of it is a route (it cannot drift),
its schemas are valid JSON Schema whose refs resolve, the configs we ship validate
against its backend body; and the findings of the schemathesis runs
(tests/component/test_admin_schemathesis.py), each held here: 405 with Allow (before the
token rule), JSON errors for what is not routed, the tuner's body as documented, a
`since` int() refuses, an engine profile that would never end."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from ext_proc.config.load import config_from_dict
from ext_proc.estimate.profile import load_profile
from ext_proc.service.admin.api import make_admin_app
from ext_proc.service.admin.openapi import admin_openapi, documented_routes
from ext_proc.service.app import make_router
from ext_proc.service.telemetry.listener import Telemetry

ROOT = Path(__file__).resolve().parents[4]
TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"Content-Type": "application/json"}


def app_for(token: str) -> web.Application:
    cfg = config_from_dict(
        {
            "policy": "gorgo",
            "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
            "backends": [{"id": "a", "address": "127.0.0.1:1"}],
            "tuner": {"mode": "paired"},
        }
    )
    router = make_router(cfg)
    return make_admin_app(router, Telemetry(cfg.telemetry, router), dict, token=token)


def app_routes(app: web.Application) -> set[tuple[str, str]]:
    """(METHOD, path) of every route; the HEAD aiohttp adds to each GET left out."""
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource}
    return {(m, p) for m, p in routes if not (m == "HEAD" and ("GET", p) in routes)}


@pytest.mark.parametrize("token", ["", TOKEN])
def test_every_route_is_documented_and_every_operation_is_a_route(token: str) -> None:
    routes = app_routes(app_for(token))
    assert routes == documented_routes(bool(token))
    assert len(routes) == 14
    assert ("GET", "/openapi.json") in routes and ("DELETE", "/backends/{id}") in routes


def resolved(doc: dict[str, Any], name: str) -> dict[str, Any]:
    """A component schema as a standalone schema: its refs resolve within it."""
    return {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}


@pytest.mark.parametrize("token", [False, True])
def test_the_schemas_are_valid_and_every_ref_resolves(token: bool) -> None:
    doc = admin_openapi(token)
    assert doc["openapi"].startswith("3.1")
    refs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.append(node["$ref"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    names = set(doc["components"]["schemas"])
    assert refs and {r.removeprefix("#/components/schemas/") for r in refs} <= names
    for name in names:
        jsonschema.Draft202012Validator.check_schema(resolved(doc, name))
    security = {
        op.get("security") is not None and op["security"] != []
        for ops in doc["paths"].values()
        for op in ops.values()
    }
    assert security == ({False, True} if token else {False})


def shipped_backends() -> list[dict[str, Any]]:
    out = []
    for path in sorted([*ROOT.glob("config/*.yaml"), *ROOT.glob("config/*/*.yaml")]):
        raw = yaml.safe_load(path.read_text())
        if isinstance(raw, dict):
            out += [b for b in raw.get("backends") or [] if isinstance(b, dict)]
    return out


def test_every_backend_of_the_shipped_configs_fits_the_post_backends_body() -> None:
    doc = admin_openapi(False)
    validator = jsonschema.Draft202012Validator(resolved(doc, "Backend"))
    backends = shipped_backends()
    assert len(backends) >= 3
    for b in backends:
        validator.validate(b)
    for bad in ({"id": "A", "address": "h:1"}, {"id": "a", "address": "http://h:1"}):
        assert not validator.is_valid(bad)


@pytest.fixture
async def token_client() -> AsyncIterator[TestClient[web.Request, web.Application]]:
    async with TestClient(TestServer(app_for(TOKEN))) as client:
        yield client


@pytest.fixture
async def open_client() -> AsyncIterator[TestClient[web.Request, web.Application]]:
    async with TestClient(TestServer(app_for(""))) as client:
        yield client


async def test_openapi_json_is_served_as_built(token_client: Any, open_client: Any) -> None:
    for client, token in ((token_client, True), (open_client, False)):
        r = await client.get("/openapi.json")
        assert r.status == 200 and r.content_type == "application/json"
        assert await r.json() == copy.deepcopy(admin_openapi(token))


async def test_a_method_a_path_does_not_serve_is_405_with_allow_before_the_token(
    token_client: Any,
) -> None:
    # Before: aiohttp's text/plain 405 came after the guard, so without the token a PUT
    # on /state was a 401 and no Allow; now 405 with Allow, JSON, token or not.
    for method, path, allow in (
        ("PUT", "/state", "GET,HEAD"),
        ("OPTIONS", "/state", "GET,HEAD"),
        ("PATCH", "/tuner", "POST"),
        ("DELETE", "/backends", "GET,HEAD,POST"),
        ("GET", "/backends/a", "DELETE"),
    ):
        for headers in ({}, AUTH):
            r = await token_client.request(method, path, headers=headers)
            assert r.status == 405, (method, path)
            assert ",".join(sorted(r.headers["Allow"].split(","))) == allow
            assert method in (await r.json())["error"]


async def test_an_unknown_path_is_a_json_404_and_the_host_rule_comes_first(
    token_client: Any,
) -> None:
    r = await token_client.post("/nope", json={})
    assert r.status == 404 and "/openapi.json" in (await r.json())["error"]
    r = await token_client.get("/nope", headers={"Host": "attacker.example:80"})
    assert r.status == 421
    r = await token_client.put("/state", headers={"Host": "attacker.example:80"})
    assert r.status == 421
    r = await token_client.get("/ui/nope.js")  # was aiohttp's text/plain 404
    assert r.status == 404 and "page.js" in (await r.json())["error"]


async def test_the_tuner_takes_only_the_keys_of_its_action(open_client: Any) -> None:
    # schemathesis: {"action": "freeze", "weights": {"rtt": 5e-324}} froze, the weights
    # silently dropped; now refused, as the document says.
    bad = [
        {"action": "freeze", "weights": {"rtt": 1, "queue": 1}},
        {"action": "unfreeze", "x": 1},
        {"action": "set"},
        {"action": "set", "weights": {"rtt": 1}},
        {"action": "set", "weights": {"rtt": 1, "queue": 1, "lora": 1}},
        {"action": "set", "weights": {"rtt": 1, "queue": True}},
    ]
    for body in bad:
        r = await open_client.post("/tuner", json=body)
        assert r.status == 400, body
    # Python's parser takes NaN and Infinity: no weights either.
    for number in ("NaN", "Infinity", "-Infinity"):
        text = f'{{"action": "set", "weights": {{"rtt": {number}, "queue": 1}}}}'
        r = await open_client.post("/tuner", data=text, headers=JSON)
        assert r.status == 400, number
    r = await open_client.get("/state")
    tuner = (await r.json())["tuner"]
    assert not tuner["frozen"] and tuner["weights"] == {"rtt": 1.0, "queue": 1.0}
    r = await open_client.post("/tuner", json={"action": "set", "weights": {"rtt": 2, "queue": 3}})
    assert r.status == 200 and (await r.json())["weights"] == {"rtt": 2.0, "queue": 3.0}


async def test_feed_since_a_digit_int_refuses_is_400_not_500(open_client: Any) -> None:
    for since in ("\u00b2", "\u0663", "-1", "1.5"):
        r = await open_client.get("/ui/feed", params={"since": since})
        assert r.status == 400, since
        assert "since" in (await r.json())["error"]
    r = await open_client.get("/ui/decision", params={"request_id": ""})
    assert r.status == 400


async def test_a_body_over_the_limit_is_a_json_413(open_client: Any) -> None:
    # Before: aiohttp's text/plain 413, which the document could not describe.
    big = b'{"action": "freeze", "pad": "' + b"x" * (1024**2) + b'"}'
    for path in ("/tuner", "/backends"):
        r = await open_client.post(path, data=big, headers=JSON)
        assert r.status == 413 and "too large" in (await r.json())["error"]


def test_an_engine_profile_that_is_no_regular_file_is_refused() -> None:
    for path in ("/dev/zero", "/tmp"):
        with pytest.raises(ValueError, match="not a regular file"):
            load_profile(path)
