"""The host:port check (ext_proc/vocab/params.py): what names resolve, and what is refused
before a probe loop or Envoy meets it."""

from __future__ import annotations

import pytest

from ext_proc.vocab.params import ConfigError, split_host_port


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("10.0.0.1:8000", "10.0.0.1"),
        ("engine-a.us-east.svc.cluster.local:8000", "engine-a.us-east.svc.cluster.local"),
        ("engine.example.com.:443", "engine.example.com."),  # fully qualified, final dot
        ("vllm_0:8000", "vllm_0"),  # compose service names may hold '_'
        ("[::1]:8000", "[::1]"),
        ("[2001:db8::7]:8000", "[2001:db8::7]"),
        (f"{'a' * 63}.io:1", f"{'a' * 63}.io"),
    ],
)
def test_addresses_that_resolve_are_taken(address: str, host: str) -> None:
    assert split_host_port(address, "k") == (host, int(address.rpartition(":")[2]))


@pytest.mark.parametrize(
    "host", ["[.:.2b720faf3c.8.]", "[10.0.0.1]", "[]", "a..b", ".a", "a.-b", "-a", f"{'a' * 64}"]
)
def test_hosts_name_resolution_would_refuse_are_refused(host: str) -> None:
    with pytest.raises(ConfigError, match=r"k: .* is not a host name or IP address"):
        split_host_port(f"{host}:8000", "k")
