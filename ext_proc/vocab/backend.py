"""A backend as the config describes it: its id, address, region, engine, profile, KV
events source and models (the `backends:` items, decoded strictly by
`ext_proc/config/load.py`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ext_proc.vocab.params import NON_NEGATIVE, bounded

# The engine profile a backend gets when it names none (ext_proc/estimate/profiles/).
DEFAULT_PROFILE = "l40s-qwen3.5-35b-a3b-fp8"


class EngineKind(enum.StrEnum):
    """Which engine serves a backend: what its probe path and metrics are."""

    SGLANG = "sglang"
    VLLM = "vllm"


class PriorityScheduling(enum.StrEnum):
    """`backends[].priority_scheduling`: whether the router writes each request's priority
    (its flow-control objective's) into the body it sends this backend's engine, in the
    engine's own order (docs/configuration.md, "Priority in the engine")."""

    # SGLang: what its /server_info says (`enable_priority_scheduling`, and
    # `schedule_low_priority_values_first` for the order); vLLM reports nothing: off.
    AUTO = "auto"
    # Written: the engine runs with priority scheduling (vLLM `--scheduling-policy
    # priority`: without it a non-zero priority is answered 400; `gorgo check` tries one).
    ON = "on"
    # Never written: a client's own `priority` goes through as it came.
    OFF = "off"


class BackendRole(enum.StrEnum):
    """`backends[].role`: what of a request its engine does. A disaggregated fleet pairs a
    prefill engine with a decode engine, the prompt's KV moving between them (SGLang
    `--disaggregation-mode prefill|decode`, vLLM's NIXL connector); the protocol is its
    engine's (`engine`)."""

    # Prefill and decode in one engine (an aggregated engine, today's default).
    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


class KvEventsMode(enum.StrEnum):
    """`backends[].kv_events.mode`: which side binds the ZMQ socket. The engine binding lets
    any number of routers connect; the router binding allows only one."""

    # The engine binds (its endpoint has `*`: SGLang's and vLLM's kv_events.py,
    # _socket_setup); the router connects: any number of routers can.
    CONNECT = "connect"
    # The engine connects to this router's address, which the router binds: one router.
    BIND = "bind"


@dataclass(frozen=True)
class KvEventsSource:
    """Where a backend's engine publishes its KV cache events (its --kv-events-config)."""

    # tcp://HOST:PORT, the router's side of the stream: what it connects to (the engine's
    # publisher as the router reaches it, any host and port: a proxy's, a WAN link's; `*`
    # = the host of `address`), or with mode bind what it binds (`*` = every interface).
    # "" = no events: the router's own estimate serves this backend.
    endpoint: str = ""
    mode: KvEventsMode = KvEventsMode.CONNECT
    topic: str = ""
    # The engine's replay endpoint (a ROUTER it always binds), to fetch what a gap lost:
    # the router connects (`*` = the host of `address`); "" = none (reset).
    replay_endpoint: str = ""
    # The engine's data-parallel ranks: each publishes on its own port, the endpoint's
    # (and the replay endpoint's) port + its rank, with its own sequence (SGLang's and
    # vLLM's kv_events.py, offset_endpoint_port). 1 = no data parallelism.
    dp_ranks: int = bounded(1, ge=1, le=256)


@dataclass(frozen=True)
class Backend:
    """One `backends:` item of the config: where Envoy reaches the engine, which engine and
    profile it is, its KV events and the models it may be sent. `id` is also its Envoy
    cluster's name and the routing header's value."""

    # Backend id = Envoy cluster name = value of the routing header.
    id: str
    # host:port where Envoy reaches this backend's engine (through its WAN link locally).
    address: str
    region: str = ""
    # The engine behind it (sglang or vllm): its probe path and metric names.
    engine: EngineKind = EngineKind.SGLANG
    # RTT assumed until the first probe answers (ms).
    rtt_prior_ms: float = bounded(50.0, **NON_NEGATIVE)
    # Engine profile (ext_proc/estimate/profiles/NAME.yaml or a file): turns tokens into ms.
    engine_profile: str = DEFAULT_PROFILE
    # KV cache the prefix index mirrors for this backend; 0 = the profile's KV pool.
    kv_capacity_tokens: int = bounded(0, **NON_NEGATIVE)
    # The engine's KV cache events: with them, what the engine really holds.
    kv_events: KvEventsSource = field(default_factory=KvEventsSource)
    # The models (and LoRA adapters) it may be sent: empty = what its engine lists on
    # /v1/models (discovered); set = only these, of what it lists once discovery answers.
    models: tuple[str, ...] = ()
    # Whether each request's priority is written for its engine's own scheduler: auto
    # (SGLang: as its /server_info says; vLLM: off, it reports nothing), on, off.
    priority_scheduling: PriorityScheduling = PriorityScheduling.AUTO
    # Prefill, decode or both (docs/configuration.md, "Prefill and decode apart").
    role: BackendRole = BackendRole.BOTH
    # SGLang prefill engines: the port of its bootstrap server
    # (`--disaggregation-bootstrap-port`, SGLang's default 8998) on the host of `address`.
    bootstrap_port: int = bounded(8998, ge=1, le=65535)
