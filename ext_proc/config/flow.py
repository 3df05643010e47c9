"""The flow-control section of the config: the gateway queue where requests wait until a
backend has room (docs/cost-model.md, "Room"), and the objectives that order it."""

from __future__ import annotations

from dataclasses import dataclass

from ext_proc.vocab.params import NON_NEGATIVE, POSITIVE, bounded


@dataclass(frozen=True)
class Objective:
    """A class of requests: its priority band, its TTFT objective, whether it may be shed,
    how long it may wait in the queue, and where it may be served."""

    name: str
    # Higher is served first (strict bands, with flow_control.starvation_s as the bound).
    priority: int = 0
    # The TTFT it should see, counted from its arrival at the router (0 = none): the
    # queue's deadline order, and a sheddable request's early refusal.
    ttft_slo_ms: float = bounded(0.0, **NON_NEGATIVE)
    # Refused at once (429) when its SLO cannot be met where it would go once room comes.
    sheddable: bool = False
    # The longest it waits in the queue before a 429 (0 = flow_control.max_wait_s).
    max_wait_s: float = bounded(0.0, **NON_NEGATIVE)
    # The backends' regions it may be served in (data residency); empty = any.
    regions: tuple[str, ...] = ()
    # Requests for these models take this objective when they name none.
    models: tuple[str, ...] = ()


@dataclass(frozen=True)
class FlowControl:
    """The gateway queue (docs/configuration.md, "Flow control")."""

    # Off: every request is bound to a backend as it arrives (the engine's queue holds it).
    enabled: bool = False
    # A backend has room while the work sent to it and not yet started there, in ms of its
    # engine's time, is below its one-way delay plus this margin: what keeps it busy until
    # the next request can reach it (docs/cost-model.md, "Room").
    room_margin_ms: float = bounded(250.0, **NON_NEGATIVE)
    # Per backend: at most this many requests waiting for their first token, and prompt
    # tokens not yet started (0 = no limit).
    max_waiting_requests: int = bounded(0, **NON_NEGATIVE)
    max_waiting_tokens: int = bounded(0, **NON_NEGATIVE)
    # Per priority band: the queue holds at most this many requests and body bytes;
    # beyond, a 429 at once.
    max_queued_requests: int = bounded(5000, **POSITIVE)
    max_queued_bytes: int = bounded(1_000_000_000, **POSITIVE)
    # The default longest wait in the queue (an objective may set its own).
    max_wait_s: float = bounded(60.0, **POSITIVE)
    # When a refused request should come back (Retry-After, and retry-after-ms exact): a
    # full band, a wait past the longest. About the time the queue takes to move (SMG
    # answers 2 s for both); an SLO that cannot be met says its own, when longer.
    retry_after_s: float = bounded(2.0, **POSITIVE)
    # A request waiting this long is served before higher bands (the starvation bound).
    starvation_s: float = bounded(30.0, **POSITIVE)
    # Fairness between tenants in a band: the tenant with the least usage (its tokens in
    # the engines, sent and not yet finished, plus its service: prompt plus output tokens,
    # halving every this many seconds) goes first.
    fairness_half_life_s: float = bounded(60.0, **POSITIVE)
    # While other tenants are active (a request within tenant_window_s), a tenant may have
    # at most tenant_share equal shares of the fleet's KV capacity in the engines (the
    # prompt and output tokens of its requests not yet finished); past it, its requests
    # wait in the router even when a backend has room, so a quieter tenant's next request
    # finds engines not filled by it. 1 = an equal share (llm-d's usage limits,
    # token-weighted); 0 = no limit. One tenant: none.
    tenant_share: float = bounded(1.0, **NON_NEGATIVE)
    # A tenant counts as sharing the engines this long after its last request: about the
    # fairness half-life (a tenant quiet for a minute has let its share go).
    tenant_window_s: float = bounded(60.0, **POSITIVE)
    # Where a request's objective, tenant and own TTFT SLO come from. The tenant header
    # must be one the front door sets (trusted), not the client's.
    objective_header: str = "x-gorgo-objective"
    tenant_header: str = "x-gorgo-tenant"
    slo_header: str = "x-gorgo-ttft-slo-ms"
    # The objective of a request that names none (and whose model maps to none); "" = a
    # built-in default: priority 0, no SLO, not sheddable.
    default_objective: str = ""
    objectives: tuple[Objective, ...] = ()


# Envoy's bound on a held request's reply beyond its longest wait in the queue (the
# scheduling after release, a busy loop).
HOLD_SLACK_S = 5.0


def max_hold_s(fc: FlowControl) -> float:
    """The longest the router may hold a request's body reply: Envoy's max_message_timeout
    (the override_message_timeout it sends for a held request is at most this)."""
    waits = [o.max_wait_s for o in fc.objectives if o.max_wait_s] + [fc.max_wait_s]
    return max(waits) + HOLD_SLACK_S
