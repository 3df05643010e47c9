"""The admin port's OpenAPI 3.1 document, served at GET /openapi.json: every route of
api.py's app (and the operator page's), its parameters, request bodies and answers, the
bearer token and the errors guard.py answers (the schemas: schemas.py).
Hand-kept beside the handlers; a test holds it to the app's routes both ways
(tests/unit/service/admin/test_openapi.py) and schemathesis holds the app to it
(tests/component/test_admin_schemathesis.py).

The document describes the admin as it is configured: with a token (`listen.admin_token`
or GORGO_ADMIN_TOKEN) every change needs it (401 without); without one a change is taken
only as JSON from a loopback peer with no foreign Origin (403 otherwise). A POST
/backends body is one item of the config's `backends:` list, its schema the config
schema's own (config/json_schema.py); the loader's checks across fields (kv_events
endpoints, an engine profile file that must exist) answer 400 with its message.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from ext_proc.service.admin.schemas import OBJECT, STRING, component_schemas, ref

OPENAPI_VERSION = "3.1.0"
TITLE = "GORGO router admin API"
JSON = "application/json"
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
# Every path but these must name the admin in Host (admin_guard.HOST_EXEMPT_PATHS).
HOST_EXEMPT = ("/healthz", "/readyz")


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _text(media_type: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {media_type: {"schema": {"type": "string"}}}}


def _error(description: str) -> dict[str, Any]:
    return _json(ref("Error"), description)


# A body over the admin's limit (api.py MAX_BODY_BYTES, 1 MiB).
TOO_LARGE = {"413": _error("The body is over 1 MiB.")}


def _id_param() -> dict[str, Any]:
    return {
        "name": "id",
        "in": "path",
        "required": True,
        "description": "The backend's id.",
        "schema": STRING,
    }


def _operations(token: bool) -> dict[str, dict[str, Any]]:
    """Each path's operations, without the answers every operation shares (`_shared`)."""
    change_refused = (
        {"401": _error("No `Authorization: Bearer <token>` or a wrong one.")}
        if token
        else {
            "403": _error(
                "Without a token, changes are taken only as application/json, from a "
                "loopback peer, with no Origin but the admin's own."
            )
        }
    )
    change: dict[str, Any] = {
        "security": [{"adminToken": []}] if token else [],
        "responses": change_refused,
    }
    fleet_404 = {"404": _error("No backend with that id.")}
    conflict = {"409": _error("The change conflicts with the backend's lifecycle.")}
    drain = {
        "tags": ["fleet"],
        "parameters": [_id_param()],
        "description": "No new decisions for the backend; removed once its requests in "
        "flight have closed.",
        "requestBody": {
            "required": False,
            "description": "Ignored (any JSON). Without a token a change is taken only as "
            "application/json: send {} with that Content-Type.",
            "content": {JSON: {"schema": {}}},
        },
        **change,
        "responses": {
            "202": _json(ref("ChangedBackend"), "Draining (or removed already)."),
            **fleet_404,
            **conflict,
            **change["responses"],
        },
    }
    return {
        "/healthz": {
            "get": {
                "tags": ["health"],
                "summary": "Liveness: the process answers.",
                "responses": {"200": _text("text/plain", "`ok`")},
            }
        },
        "/readyz": {
            "get": {
                "tags": ["health"],
                "summary": "Readiness: whether the router can route now, and why.",
                "responses": {
                    "200": _json(ref("Readiness"), "Ready."),
                    "503": _json(ref("Readiness"), "Not ready (the reason says why)."),
                },
            }
        },
        "/metrics": {
            "get": {
                "tags": ["telemetry"],
                "summary": "Prometheus metrics (docs/operations.md lists them).",
                "responses": {"200": _text(PROMETHEUS_TEXT, "Prometheus text format 0.0.4.")},
            }
        },
        "/state": {
            "get": {
                "tags": ["state"],
                "summary": "The router's state: policy, weights, tuner, backends, flow.",
                "responses": {"200": _json(ref("State"), "The state.")},
            }
        },
        "/openapi.json": {
            "get": {
                "tags": ["state"],
                "summary": "This document.",
                "responses": {"200": _json(OBJECT, "OpenAPI 3.1.")},
            }
        },
        "/tuner": {
            "post": {
                "tags": ["tuner"],
                "summary": "Freeze, unfreeze or set the tuner's weights.",
                "requestBody": {
                    "required": True,
                    "content": {JSON: {"schema": ref("TunerChange")}},
                },
                **change,
                "responses": {
                    "200": _json(ref("Tuner"), "The tuner after the change."),
                    "400": _error("Not JSON, an unknown action, or weights not both > 0."),
                    **TOO_LARGE,
                    "409": _error("No tuner (its policy has none, or tuner.mode is off)."),
                    **change["responses"],
                },
            }
        },
        "/backends": {
            "get": {
                "tags": ["fleet"],
                "summary": "The fleet: each backend's lifecycle, requests and config.",
                "responses": {"200": _json(ref("Fleet"), "The fleet.")},
            },
            "post": {
                "tags": ["fleet"],
                "summary": "Add a backend (one item of the config's `backends:`).",
                "description": "Answers once the backend is a candidate (Envoy has its "
                "cluster) or after 6 s with it still pending.",
                "requestBody": {"required": True, "content": {JSON: {"schema": ref("Backend")}}},
                **change,
                "responses": {
                    "201": _json(ref("ChangedBackend"), "Added."),
                    "400": _error(
                        "Not one backend object, or refused by the config's checks "
                        "(id, address, kv_events, engine_profile)."
                    ),
                    "409": _error("A backend with that id is in the fleet already."),
                    **TOO_LARGE,
                    **change["responses"],
                },
            },
        },
        "/backends/{id}/drain": {"post": {**drain, "summary": "Drain a backend."}},
        "/backends/{id}": {"delete": {**drain, "summary": "Drain a backend (REST spelling)."}},
        "/ui": {
            "get": {
                "tags": ["page"],
                "summary": "The operator's page.",
                "responses": {"200": _text("text/html", "The page.")},
            }
        },
        "/ui/feed": {
            "get": {
                "tags": ["page"],
                "summary": "What changed since the page's last poll.",
                "parameters": [
                    {
                        "name": "since",
                        "in": "query",
                        "description": "The last decision sequence number seen (0: all).",
                        "schema": {"type": "integer", "minimum": 0},
                    },
                    {
                        "name": "steps",
                        "in": "query",
                        "description": "The tuner path's key last seen.",
                        "schema": STRING,
                    },
                ],
                "responses": {
                    "200": _json(ref("Feed"), "The changes."),
                    "400": _error("`since` is not an integer >= 0."),
                },
            }
        },
        "/ui/decision": {
            "get": {
                "tags": ["page"],
                "summary": "One recent decision with every candidate.",
                "parameters": [
                    {
                        "name": "request_id",
                        "in": "query",
                        "required": True,
                        "schema": {"type": "string", "minLength": 1},
                    }
                ],
                "responses": {
                    "200": _json(ref("Decision"), "The decision."),
                    "400": _error("No request_id, or an empty one."),
                    "404": _error("No recent decision for that request id."),
                },
            }
        },
        "/ui/{name}": {
            "get": {
                "tags": ["page"],
                "summary": "The page's script and style.",
                "parameters": [{"name": "name", "in": "path", "required": True, "schema": STRING}],
                "responses": {
                    "200": {
                        "description": "The asset.",
                        "content": {
                            "text/javascript": {"schema": STRING},
                            "text/css": {"schema": STRING},
                        },
                    },
                    "404": _error("No such asset."),
                },
            }
        },
    }


def _shared(path: str) -> dict[str, Any]:
    """Answers every operation on `path` may give before its handler runs."""
    out: dict[str, Any] = {}
    if path not in HOST_EXEMPT:
        out["421"] = _error(
            "The Host header names no address of this admin (DNS rebinding); add the "
            "name to listen.admin_hosts."
        )
    return out


@cache
def admin_openapi(token: bool) -> dict[str, Any]:
    """The document for an admin with (`token`) or without a token configured (built
    once per kind and shared: do not change it)."""
    paths: dict[str, Any] = {}
    for path, operations in _operations(token).items():
        paths[path] = {}
        for method, op in operations.items():
            op = {**op, "responses": {**op["responses"], **_shared(path)}}
            op["operationId"] = f"{method}_{path.strip('/').replace('/', '_') or 'root'}"
            paths[path][method] = op
    security_schemes = {
        "adminToken": {
            "type": "http",
            "scheme": "bearer",
            "description": "listen.admin_token (or GORGO_ADMIN_TOKEN): required on every "
            "change when set.",
        }
    }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": TITLE,
            "version": "1",
            "description": (
                "The router's admin port (listen.admin; docs/operations.md). "
                + (
                    "A token is configured: every change (any method but GET and HEAD) "
                    "needs Authorization: Bearer <token>."
                    if token
                    else "No token is configured: changes are taken as JSON from a "
                    "loopback peer with no foreign Origin."
                )
                + " Every path but /healthz and /readyz must be reached with a Host "
                'naming the admin. Errors are JSON: {"error": "..."}. A method a path '
                "does not serve: 405 with Allow."
            ),
        },
        "paths": paths,
        "components": {"schemas": component_schemas(), "securitySchemes": security_schemes},
    }


def documented_routes(token: bool = False) -> set[tuple[str, str]]:
    """(METHOD, path) of every operation the document describes."""
    return {
        (method.upper(), path)
        for path, ops in admin_openapi(token)["paths"].items()
        for method in ops
    }


__all__ = ["admin_openapi", "documented_routes"]
