"""Envoy <-> ext_proc over TLS and mTLS, with the real Envoy: an Envoy with the right
client certificate is routed by the policy; one without it cannot reach the router and
fails open (every request still served)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from emulator.stack.ports import free_ports
from emulator.stack.stack import Stack
from ext_proc.config.schema import Config
from ext_proc.config.transport import ClientTls, ServerTls
from ext_proc.envoy_config.bootstrap import render_envoy_config
from loadgen.client.stream import chat_body
from tests.certs import Ca
from tests.e2e.conftest import FAST_REGIONS, fast_settings
from tests.e2e.stack_harness import chats, router_state, wait_for

pytestmark = pytest.mark.e2e


def with_tls(cfg: Config, server: ServerTls, client: ClientTls) -> Config:
    return dataclasses.replace(
        cfg,
        listen=dataclasses.replace(cfg.listen, tls=server),
        envoy=dataclasses.replace(cfg.envoy, ext_proc_tls=client),
    )


def test_mtls_routes_and_an_envoy_without_a_client_certificate_fails_open(
    tmp_path: Path,
) -> None:
    ca = Ca(tmp_path)
    server = ca.issue("gorgo-ext-proc")
    envoy_client = ca.issue("envoy")
    s = Stack(fast_settings("round_robin"))
    s.config = with_tls(
        s.config,
        ServerTls(str(server.cert), str(server.key), client_ca_file=str(ca.pem.cert)),
        ClientTls(str(ca.pem.cert), str(envoy_client.cert), str(envoy_client.key)),
    )
    s.start()
    try:
        results = asyncio.run(chats(s.front_door_url, [chat_body("over mtls", 2)] * 6))
        assert all(r.ok for r in results), [r.error for r in results]
        wait_for(lambda: router_state(s)["decisions"] == 6)  # routed by the policy
        assert sorted(r.backend for r in results) == sorted([r.id for r in FAST_REGIONS] * 2)

        # A second Envoy that trusts the server but has no client certificate.
        listen, admin = free_ports(2)
        rogue = with_tls(s.config, s.config.listen.tls, ClientTls(str(ca.pem.cert)))
        rogue = dataclasses.replace(
            rogue,
            envoy=dataclasses.replace(
                rogue.envoy, listen=f"127.0.0.1:{listen}", admin=f"127.0.0.1:{admin}"
            ),
        )
        s.start_envoy("envoy-no-client-cert", render_envoy_config(rogue))
        url = f"http://127.0.0.1:{listen}"
        wait_for(lambda: asyncio.run(chats(url, [chat_body("x", 1)]))[0].ok, timeout_s=10)
        results = asyncio.run(chats(url, [chat_body("no cert", 2)] * 4))
        assert all(r.ok for r in results), [r.error for r in results]  # failed open
        assert router_state(s)["decisions"] == 6  # the router never saw them
    finally:
        s.stop()
