"""The building blocks of the config's schema: its error, each number field's range
(`bounded(...)`) and the host:port check. A leaf: it imports nothing of the router.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration value is missing, unknown or of the wrong type or range."""


@dataclass(frozen=True)
class Range:
    """Bounds of a number field; None = unbounded on that side."""

    gt: float | None = None
    ge: float | None = None
    le: float | None = None

    def check(self, value: float, key: str) -> None:
        if self.gt is not None and not value > self.gt:
            raise ConfigError(f"{key}: must be > {self.gt:g}, got {value}")
        if self.ge is not None and not value >= self.ge:
            raise ConfigError(f"{key}: must be >= {self.ge:g}, got {value}")
        if self.le is not None and not value <= self.le:
            raise ConfigError(f"{key}: must be <= {self.le:g}, got {value}")


def bounded(
    default: Any, *, gt: float | None = None, ge: float | None = None, le: float | None = None
) -> Any:
    """A number field with its allowed range, checked at load."""
    return field(default=default, metadata={"range": Range(gt, ge, le)})


POSITIVE = {"gt": 0.0}
NON_NEGATIVE = {"ge": 0.0}


# A DNS name or IPv4 address: dot-separated labels of 1-63 letters, digits, '-' and '_'
# (an empty label, as in "a..b", fails name resolution: IDNA rejects it).
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def _is_host(host: str) -> bool:
    """A DNS name, an IPv4 address, or [IPv6] (an address `ipaddress` reads)."""
    if host.startswith("[") and host.endswith("]"):
        try:
            return ipaddress.ip_address(host[1:-1]).version == 6
        except ValueError:
            return False
    name = host.removesuffix(".")  # a fully qualified name may end in a dot
    return len(name) <= 253 and all(_LABEL.fullmatch(label) for label in name.split("."))


def split_host_port(value: str, key: str) -> tuple[str, int]:
    """`host:port`, as Envoy's socket addresses and gRPC targets take it: no scheme, no
    spaces, a port 0-65535. The error names the key and what to write instead."""
    if "://" in value:
        bare = value.split("://", 1)[1].rstrip("/")
        raise ConfigError(
            f"{key}: expected host:port without a scheme, got {value!r} (write {bare!r})"
        )
    if any(c.isspace() for c in value):
        raise ConfigError(f"{key}: expected host:port without spaces, got {value!r}")
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{key}: expected host:port, got {value!r}")
    if not 0 <= int(port) <= 65535:
        raise ConfigError(f"{key}: port {port} is out of range (0-65535), got {value!r}")
    if not _is_host(host):
        raise ConfigError(f"{key}: {host!r} is not a host name or IP address, got {value!r}")
    return host, int(port)
