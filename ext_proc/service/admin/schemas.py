"""The admin API's component schemas (openapi.py's document): the answers' shapes,
and the POST /backends body, which is the config schema's own backend item
(config/json_schema.py) with the loader's forms for its id, address and endpoints."""

from __future__ import annotations

import copy
from typing import Any

from ext_proc.config.json_schema import SchemaBuilder
from ext_proc.estimate.profile import profile_names
from ext_proc.vocab.backend import Backend
from ext_proc.vocab.types import BackendLifecycle

REF = "#/components/schemas/"
# The loader's id rule for a backend (config/load.py _BACKEND_ID) and the address's form
# (vocab/params.py split_host_port: a host name or a bracketed IPv6 address, a port).
BACKEND_ID_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
ADDRESS_PATTERN = (
    r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?):"
    r"([0-9]{1,4}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])$"
)

# kv_events.endpoint and replay_endpoint (config/kv_endpoints.py split_tcp_endpoint).
KV_ENDPOINT_PATTERN = (
    r"^$|^tcp://(\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?):[0-9]{1,5}$"
)


def ref(name: str) -> dict[str, str]:
    return {"$ref": REF + name}


NUMBER = {"type": "number"}
INTEGER = {"type": "integer"}
COUNT = {"type": "integer", "minimum": 0}
STRING = {"type": "string"}
BOOLEAN = {"type": "boolean"}
OBJECT = {"type": "object"}
ARRAY = {"type": "array"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _object(required: dict[str, Any], **optional: Any) -> dict[str, Any]:
    """An object with these keys always present (more may follow: the router adds
    figures without a new API version)."""
    return {"type": "object", "properties": {**required, **optional}, "required": list(required)}


WEIGHTS = _object({"rtt": NUMBER, "queue": NUMBER})
LIFECYCLE = {"type": "string", "enum": [str(v) for v in BackendLifecycle]}


def component_schemas() -> dict[str, Any]:
    """components.schemas: the answers' shapes and the Backend body (the config's)."""
    builder = SchemaBuilder()
    builder.section(Backend)
    defs = _rebased(builder.defs)
    body = defs["Backend"]
    body["properties"]["id"]["pattern"] = BACKEND_ID_PATTERN
    body["properties"]["address"]["pattern"] = ADDRESS_PATTERN
    for key in ("endpoint", "replay_endpoint"):  # "" (none) or tcp://HOST:PORT
        defs["KvEventsSource"]["properties"][key]["pattern"] = KV_ENDPOINT_PATTERN
    profile = body["properties"]["engine_profile"]
    profile["anyOf"] = [
        {"enum": profile_names()},
        {"pattern": r"\.ya?ml$", "description": "a profile file on the router's host"},
    ]
    backend_state = _object(
        {
            "lifecycle": LIFECYCLE,
            "in_flight": COUNT,
            "completed": COUNT,
            "errors": COUNT,
            "suspect": BOOLEAN,
            "ejected": BOOLEAN,
            "rtt_ms": NUMBER,
            "queue_ms": NUMBER,
            "lifecycle_age_s": NUMBER,
        }
    )
    return {
        **defs,
        "Error": {
            "type": "object",
            "description": "Every refusal of the admin port: what was wrong, in a sentence.",
            "properties": {"error": STRING},
            "required": ["error"],
            "additionalProperties": False,
        },
        "Readiness": _object({"ready": BOOLEAN, "reason": STRING}),
        "Tuner": _object(
            {
                "mode": STRING,
                "weights": WEIGHTS,
                "frozen": BOOLEAN,
                "samples": COUNT,
                "recent_steps": ARRAY,
            }
        ),
        # The tuner of a disaggregated fleet's pair knobs (docs/tuner.md, "The P/D knobs").
        "PairTuner": _object(
            {
                "mode": STRING,
                "knobs": _object({"local_threshold_tokens": NUMBER, "remote_margin_ms": NUMBER}),
                "samples": COUNT,
                "recent_steps": ARRAY,
            }
        ),
        "BackendState": backend_state,
        "State": _object(
            {
                "policy": STRING,
                "weights": _nullable(WEIGHTS),
                "tuner": _nullable(ref("Tuner")),
                "decisions": COUNT,
                "pair_tuner": _nullable(ref("PairTuner")),
                "in_flight": COUNT,
                "backends": {"type": "object", "additionalProperties": ref("BackendState")},
                "removed_backends": ARRAY,
                "recent_decisions": ARRAY,
                "active_ext_proc_streams": COUNT,
                "flow": _object({"enabled": BOOLEAN}),
            }
        ),
        "FleetBackend": _object(
            {
                "id": STRING,
                "lifecycle": LIFECYCLE,
                "lifecycle_age_s": NUMBER,
                "in_flight": COUNT,
                "peer_in_flight": INTEGER,
                "config": ref("Backend"),
            }
        ),
        "Fleet": _object(
            {
                "backends": {"type": "array", "items": ref("FleetBackend")},
                "removed": {"type": "array", "items": OBJECT},
            }
        ),
        # A drained backend's answer: as in the fleet, or {id, lifecycle: removed} once
        # it is gone (no requests were in flight there).
        "ChangedBackend": _object({"id": STRING, "lifecycle": LIFECYCLE}),
        "TunerChange": {
            "description": 'Freeze or unfreeze the tuner, or "set" its weights (both > 0).',
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"action": {"type": "string", "enum": ["freeze", "unfreeze"]}},
                    "required": ["action"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {
                        "action": {"const": "set"},
                        "weights": {
                            "type": "object",
                            "properties": {
                                "rtt": {"type": "number", "exclusiveMinimum": 0},
                                "queue": {"type": "number", "exclusiveMinimum": 0},
                            },
                            "required": ["rtt", "queue"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["action", "weights"],
                    "additionalProperties": False,
                },
            ],
        },
        "Feed": _object(
            {
                "seq": COUNT,
                "now_s": NUMBER,
                "policy": STRING,
                "in_flight": COUNT,
                "backends": {"type": "array", "items": OBJECT},
                "decisions": {"type": "array", "items": OBJECT},
                "terms": {"type": "array", "items": OBJECT},
            }
        ),
        "Decision": _object({"id": STRING, "backend": STRING, "candidates": ARRAY, "terms": ARRAY}),
    }


def _rebased(defs: dict[str, Any]) -> dict[str, Any]:
    """The config schema's `$defs` as components: each `#/$defs/X` becomes a component ref."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                k: (REF + v.removeprefix("#/$defs/"))
                if k == "$ref" and isinstance(v, str)
                else walk(v)
                for k, v in node.items()
            }
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    out: dict[str, Any] = walk(copy.deepcopy(defs))
    return out


__all__ = ["REF", "component_schemas", "ref"]
