"""Who may use the admin port, decided per request before any handler runs (api.py's
middleware applies it). Pure: the request's method, path, headers and the socket it came
on in, a refusal (status, message) or None out.

Three rules, against what a web page in the operator's browser could otherwise do to a
router on the same machine (docs/reliability.md, Security):

- The Host: every request but /healthz and /readyz must name this admin: the address it
  listens on, the local address the connection came in on, `localhost` / `127.0.0.1` /
  `[::1]` (each with the port) for a connection over loopback, or a name in
  `listen.admin_hosts`. A page on attacker.example whose name was made to resolve to
  127.0.0.1 (DNS rebinding) sends `Host: attacker.example:9180` and reads nothing.
  /healthz and /readyz are exempt: they say whether the router lives and can route, in a
  few words that name no backend, and Kubernetes' kubelet probes them by the pod's IP.
- With a token (`listen.admin_token`): every state change (any method but GET and HEAD)
  carries `Authorization: Bearer <token>`, which a page elsewhere cannot send without a
  CORS preflight the admin never grants.
- Without a token: a state change comes from a loopback peer, as JSON
  (`Content-Type: application/json`, which a page elsewhere can only send after a
  preflight), and with no `Origin` or this admin's own: a cross-origin `text/plain` or
  form POST needs no preflight, so it is refused here (403).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass

SAFE_METHODS = frozenset({"GET", "HEAD"})
# Say whether it lives and can route, nothing more; probed by IP (kubelet), so the Host
# rule would only break them.
HOST_EXEMPT_PATHS = frozenset({"/healthz", "/readyz"})
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})


def _loopback_ip(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def split_authority(value: str) -> tuple[str, str]:
    """`Host`'s name and port, lower-cased: ("[::1]", "9180"), ("gorgo", ""), ..."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value.partition("]")
        return f"{name}]", rest.removeprefix(":")
    if value.count(":") == 1:
        name, _, port = value.partition(":")
        return name, port
    return value, ""  # a bare name, or an unbracketed IPv6 address (no port then)


def _as_host(ip: str) -> str:
    """An IP as a Host header writes it (IPv6 in brackets)."""
    return f"[{ip}]" if ":" in ip and not ip.startswith("[") else ip


@dataclass(frozen=True)
class Peer:
    """The connection a request came on: the client's IP and the local (ip, port) it
    reached (None for what a test or a Unix socket does not have)."""

    remote: str | None
    local_ip: str | None = None
    local_port: int | None = None


@dataclass(frozen=True)
class AdminGuard:
    """The admin port's three rules (the module's docstring) for one listen address, token
    and set of extra host names; the admin's middleware asks `refuse` before any handler."""

    # listen.admin as configured (host:port; port 0 = whatever was bound)
    listen: str
    token: str = ""
    # listen.admin_hosts: `name` (any port) or `name:port`
    extra_hosts: tuple[str, ...] = ()

    def accepted_hosts(self, peer: Peer) -> list[str]:
        """The Host values this admin answers on that connection, for the error message."""
        listen_host, _, listen_port = self.listen.rpartition(":")
        port = str(peer.local_port) if peer.local_port else listen_port
        names = [] if listen_host.lower() in WILDCARDS else [listen_host.lower()]
        if peer.local_ip and _as_host(peer.local_ip) not in names:
            names.append(_as_host(peer.local_ip))
        if _loopback_ip(listen_host) or (peer.local_ip and _loopback_ip(peer.local_ip)):
            names += [n for n in LOOPBACK_NAMES if n not in names]
        return [f"{n}:{port}" for n in names] + [h.lower() for h in self.extra_hosts]

    def host_ok(self, host: str | None, peer: Peer) -> bool:
        if host is None:
            return True  # HTTP/1.0 without Host: not a browser
        name, port = split_authority(host)
        for accepted in self.accepted_hosts(peer):
            a_name, a_port = split_authority(accepted)
            if name == a_name and (port == a_port or not a_port):
                return True
        return False

    def refuse_host(
        self, path: str, headers: Mapping[str, str], peer: Peer
    ) -> tuple[int, str] | None:
        """The Host rule alone: (421, why) when the request does not name this admin."""
        host = headers.get("Host")
        if path not in HOST_EXEMPT_PATHS and not self.host_ok(host, peer):
            listen_host = self.listen.rpartition(":")[0]
            where = (
                "this admin listens on all interfaces"
                if listen_host.lower() in WILDCARDS
                else f"this admin listens on {self.listen}"
            )
            return 421, (
                f"Host {host!r} is not this admin's address ({where}; it answers to "
                f"{', '.join(self.accepted_hosts(peer))}): refused so that a web page "
                "elsewhere cannot read it by DNS rebinding. If you reach the admin by this "
                f"name, add {split_authority(host or '')[0]!r} to listen.admin_hosts"
            )
        return None

    def refuse(
        self, method: str, path: str, headers: Mapping[str, str], peer: Peer
    ) -> tuple[int, str] | None:
        """Why this request is refused (HTTP status, message), or None to let it through."""
        refusal = self.refuse_host(path, headers, peer)
        if refusal is not None:
            return refusal
        if method in SAFE_METHODS:
            return None
        host = headers.get("Host")
        if self.token:
            sent = headers.get("Authorization", "")
            if not hmac.compare_digest(sent.encode(), f"Bearer {self.token}".encode()):
                return 401, "admin token required: Authorization: Bearer <token>"
            return None
        if peer.remote is not None and not _loopback_ip(peer.remote):
            # An open admin on the network could route prompts anywhere (POST /backends).
            return 403, (
                "changes from another host need a token: set listen.admin_token "
                "(or GORGO_ADMIN_TOKEN) and send Authorization: Bearer <token>"
            )
        origin = headers.get("Origin")
        if origin is not None and not _same_origin(origin, host):
            return 403, (
                f"Origin {origin!r} is not this admin's: a page on another site may not "
                "change its state (without listen.admin_token, changes are taken from "
                "this host's own tools only, which send no Origin)"
            )
        media_type = headers.get("Content-Type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            return 403, (
                f"Content-Type {media_type or 'none'!r}: changes without listen.admin_token "
                "must be sent as application/json (a web page elsewhere can post text/plain "
                "or a form without asking first; JSON it cannot)"
            )
        return None


def _same_origin(origin: str, host: str | None) -> bool:
    """The admin's own page: Origin http(s)://<the Host this request was sent to>."""
    if host is None:
        return False
    scheme, sep, authority = origin.strip().lower().partition("://")
    return bool(sep) and scheme in ("http", "https") and authority == host.strip().lower()


__all__ = ["AdminGuard", "Peer", "split_authority"]
