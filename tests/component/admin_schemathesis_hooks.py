"""schemathesis hooks for the admin API's runs (SCHEMATHESIS_HOOKS names this module):
a backend added with `kv_events.mode: bind` makes the router bind the endpoint's port,
which may be any port on this shared machine (9090, 10000, ...): such bodies are not
sent. Every other body is."""

from __future__ import annotations

from typing import Any

import schemathesis


def binds_a_port(body: Any) -> bool:
    kv = body.get("kv_events") if isinstance(body, dict) else None
    return isinstance(kv, dict) and kv.get("mode") == "bind"


@schemathesis.hook
def filter_case(context: Any, case: Any) -> bool:
    return not (case.operation.path == "/backends" and binds_a_port(case.body))
