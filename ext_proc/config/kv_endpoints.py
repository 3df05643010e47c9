"""A backend's KV-event endpoints: their checks at load, and where the router's sockets go.

Both engines' publishers bind an endpoint with `*` in it and connect to any other (SGLang's
python/sglang/srt/disaggregation/kv_events.py and vLLM's vllm/distributed/kv_events.py,
`_socket_setup`); their replay ROUTER always binds. So the config says which side the
router is on (`kv_events.mode`) instead of it being guessed from the host: mode connect
(the engine binds) connects the router's SUB socket to `endpoint`, on any host and port
(the engine's own, a proxy's, a WAN link's); mode bind (the engine connects to the router)
binds it. The replay DEALER always connects. `*` as a host to connect to is the backend
address's host (the shorthand for an engine reached directly); to bind, every interface.
"""

from __future__ import annotations

from collections.abc import Sequence

from ext_proc.vocab.backend import Backend, KvEventsMode
from ext_proc.vocab.params import ConfigError, split_host_port

TCP = "tcp://"
# Hosts that are every interface of a machine: something to bind, nothing to connect to.
_ANY = ("*", "0.0.0.0", "[::]")


def split_tcp_endpoint(value: str, key: str) -> tuple[str, int]:
    """`tcp://HOST:PORT` (HOST a name, an IPv4 address, [IPv6] or `*`) -> (HOST, PORT);
    the error names the key and what is wrong."""
    if not value.startswith(TCP):
        raise ConfigError(f"{key}: expected tcp://HOST:PORT (ZMQ over TCP), got {value!r}")
    host, sep, port = value[len(TCP) :].rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{key}: expected tcp://HOST:PORT (a port after the host), got {value!r}")
    if not 1 <= int(port) <= 65535:
        raise ConfigError(f"{key}: port {port} is out of range (1-65535), got {value!r}")
    if host != "*":
        split_host_port(f"{host}:{port}", key)  # a host name or IP address, no spaces
    return host, int(port)


def connect_address(endpoint: str, backend_host: str) -> str:
    """The address a socket connects to for `endpoint` (`*`: the backend's host)."""
    host, port = split_tcp_endpoint(endpoint, "kv_events endpoint")
    return f"{TCP}{backend_host if host == '*' else host}:{port}"


def subscriber_address(endpoint: str, mode: KvEventsMode, backend_host: str) -> tuple[str, bool]:
    """Where the router's SUB socket goes for a (DP rank's) endpoint, and whether it binds."""
    if mode is KvEventsMode.BIND:
        split_tcp_endpoint(endpoint, "kv_events endpoint")
        return endpoint, True
    return connect_address(endpoint, backend_host), False


def _ports(port: int, ranks: int) -> range:
    return range(port, port + ranks)  # DP rank r on port + r (offset_endpoint_port)


def validate_kv_events(b: Backend, prefix: str) -> None:
    """One backend's kv_events: well-formed endpoints, a host to connect to where the
    router connects, the DP ranks' ports in range; errors name `prefix` + the key."""
    kv, ranks = b.kv_events, b.kv_events.dp_ranks
    backend_host = split_host_port(b.address, f"{prefix}address")[0]
    reached: dict[str, tuple[str, range]] = {}
    for key in ("endpoint", "replay_endpoint"):
        value, full = getattr(kv, key), f"{prefix}kv_events.{key}"
        if not value:
            continue
        host, port = split_tcp_endpoint(value, full)
        if port + ranks - 1 > 65535:
            raise ConfigError(
                f"{full}: DP rank r publishes on port + r: with dp_ranks {ranks} the port is "
                f"at most {65536 - ranks}, got {value!r}"
            )
        if key == "endpoint" and kv.mode is KvEventsMode.BIND:
            continue
        if host == "*":
            host = backend_host
            if host in _ANY:
                raise ConfigError(
                    f"{full}: `*` connects to the host of address {b.address!r}, which is no "
                    f"host to connect to: write tcp://ENGINE_HOST:{port}"
                )
        elif host in _ANY:
            raise ConfigError(
                f"{full}: the router connects here and {host} is no host to connect to: write "
                "the engine's host as the router reaches it (or, for the event stream, the "
                "router's own address with mode: bind)"
            )
        reached[key] = (host, _ports(port, ranks))
    if kv.replay_endpoint and not kv.endpoint:
        raise ConfigError(f"{prefix}kv_events.replay_endpoint: set endpoint too (none: no events)")
    if len(reached) == 2 and _overlap(reached["endpoint"], reached["replay_endpoint"]):
        raise ConfigError(
            f"{prefix}kv_events.replay_endpoint: the same host and port as endpoint (the "
            f"engine binds each on its own port), got {kv.replay_endpoint!r}"
        )


def _overlap(a: tuple[str, range], b: tuple[str, range]) -> bool:
    same_host = a[0] == b[0] or a[0] in _ANY or b[0] in _ANY
    return same_host and bool(set(a[1]) & set(b[1]))


def validate_distinct_binds(backends: Sequence[Backend]) -> None:
    """No two backends' subscribers bind the same port: the second bind would fail."""
    bound: list[tuple[int, tuple[str, range]]] = []
    for i, b in enumerate(backends):
        if not b.kv_events.endpoint or b.kv_events.mode is not KvEventsMode.BIND:
            continue
        host, port = split_tcp_endpoint(b.kv_events.endpoint, "kv_events.endpoint")
        mine = (host, _ports(port, b.kv_events.dp_ranks))
        for j, other in bound:
            if _overlap(mine, other):
                raise ConfigError(
                    f"backends[{i}].kv_events.endpoint: backends[{j}] binds the same port "
                    f"({b.kv_events.endpoint!r} with mode bind): give each engine its own"
                )
        bound.append((i, mine))
