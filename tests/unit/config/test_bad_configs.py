"""The bad configs a reviewer would try: each gets one clear error that names the key
(and says what to write instead where it can)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ext_proc.config.load import config_from_dict, read_config
from ext_proc.vocab.params import ConfigError
from tests.fuzz.runner import findings

OK = {"id": "a", "address": "10.0.0.1:8000"}


def with_backend(**b: Any) -> dict[str, Any]:
    return {"backends": [{**OK, **b}]}


def with_key(section: str, **kv: Any) -> dict[str, Any]:
    return {"backends": [OK], section: kv}


CASES = [
    # addresses
    (
        with_backend(address="http://10.0.0.1:8000"),
        r"backends\[0\].address: .*without a scheme.*'10.0.0.1:8000'",
    ),
    (with_backend(address="not a host:8000"), r"backends\[0\].address: .*without spaces"),
    (with_backend(address=" 10.0.0.1:8000"), r"backends\[0\].address: .*without spaces"),
    (with_backend(address="10.0.0.1:99999"), r"backends\[0\].address: port 99999 is out of range"),
    (with_backend(address="10.0.0.1"), r"backends\[0\].address: expected host:port"),
    (with_backend(address="10.0.0.1:http"), r"backends\[0\].address: expected host:port"),
    (
        with_backend(address="bad/host:8000"),
        r"backends\[0\].address: 'bad/host' is not a host name",
    ),
    # what the admin API's fuzzer sent: each passed a pattern, then failed name resolution
    # (IDNA: an empty label) inside the probe loop
    (
        with_backend(address="[.:.2b720faf3c.8.]:65079"),
        r"backends\[0\].address: '\[.:.2b720faf3c.8.\]' is not a host name",
    ),
    (with_backend(address="a..b:8000"), r"backends\[0\].address: 'a..b' is not a host name"),
    (with_backend(address=f"{'x' * 64}.io:8000"), r"backends\[0\].address: 'x+.io' is not a"),
    (
        with_key("envoy", tracing_endpoint="http://otel:4317"),
        r"envoy.tracing_endpoint: .*'otel:4317'",
    ),
    (with_key("envoy", ext_proc_address="gorgo :50051"), r"envoy.ext_proc_address: .*spaces"),
    (
        with_key("telemetry", otlp_endpoint="http://otel:4317"),
        r"telemetry.otlp_endpoint: .*without a scheme.*\(write 'otel:4317'\)",
    ),
    (
        with_key("telemetry", otlp_endpoint="https://otel:4317"),
        r"telemetry.otlp_endpoint: .*\(write 'otel:4317' and set telemetry.otlp_tls: true\)",
    ),
    (with_key("telemetry", otlp_endpoint="otel"), r"telemetry.otlp_endpoint: expected host:port"),
    (
        with_key("envoy", ext_proc_addresses=["127.0.0.1:1", "https://r2:2"]),
        r"envoy.ext_proc_addresses\[1\]: .*scheme",
    ),
    (with_key("envoy", listen="0.0.0.0:70000"), r"envoy.listen: port 70000 is out of range"),
    (with_key("listen", grpc="localhost"), r"listen.grpc: expected host:port"),
    (with_key("listen", admin="http://127.0.0.1:9180"), r"listen.admin: .*scheme"),
    (
        with_key("listen", admin_hosts=["gorgo", "http://gorgo:9180"]),
        r"listen.admin_hosts\[1\]: expected a host name or name:port .*'http://gorgo:9180'",
    ),
    (with_key("listen", admin_hosts="gorgo"), r"listen.admin_hosts: expected a list"),
    # unknown keys, with the near miss
    ({"backends": [OK], "polcy": "gorgo"}, r"polcy: unknown key \(did you mean 'policy'\?"),
    (
        with_key("routing", block_tokns=16),
        r"routing.block_tokns: unknown key \(did you mean 'block_tokens'\?",
    ),
    (
        {"backends": [{"id": "a", "adress": "10.0.0.1:8000"}]},
        r"backends\[0\].adress: unknown key \(did you mean 'address'\?",
    ),
    (
        with_key("probes", intervl_s=1),
        r"probes.intervl_s: unknown key \(did you mean 'interval_s'\?",
    ),
    # values
    ({"backends": [OK], "policy": "gorgoo"}, r"policy: unknown policy 'gorgoo'"),
    (
        with_backend(engine_profile="nope"),
        r"backends\[0\].engine_profile: unknown engine profile 'nope'",
    ),
    (with_backend(engine="tgi"), r"backends\[0\].engine: "),
    (with_backend(rtt_prior_ms=-1), r"backends\[0\].rtt_prior_ms: must be >= 0"),
    ({"backends": [OK, OK]}, r"backends\[1\].id: duplicate backend id 'a'"),
    ({"backends": []}, r"backends"),
    (with_key("telemetry", sample_ratio=1.5), r"telemetry.sample_ratio: must be <= 1"),
    # the router's OTLP exporter over TLS
    (
        with_key("telemetry", otlp_ca_file="/etc/ssl/ca.pem"),
        r"telemetry.otlp_ca_file: set telemetry.otlp_tls: true to use it",
    ),
    (
        with_key("telemetry", otlp_tls=True, otlp_cert_file="/c.pem"),
        r"telemetry.otlp_cert_file, otlp_key_file: .*go together",
    ),
    (
        with_key("telemetry", otlp_tls=True, otlp_ca_file="/nonexistent/ca.pem"),
        r"telemetry.otlp_ca_file: cannot read '/nonexistent/ca.pem'",
    ),
    (with_key("telemetry", otlp_tls="yes"), r"telemetry.otlp_tls: expected true or false"),
]


@pytest.mark.parametrize(("raw", "error"), CASES, ids=[c[1][:40] for c in CASES])
def test_a_bad_config_gets_one_clear_error_naming_its_key(raw: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        config_from_dict(raw)


def test_a_hand_written_profile_missing_keys_names_them_all(tmp_path: Path) -> None:
    profile = tmp_path / "my-gpu.yaml"
    profile.write_text(yaml.safe_dump({"prefill_tokens_per_s": 20000, "prefill_base_ms": 5}))
    with pytest.raises(ConfigError, match=r"backends\[0\].engine_profile: .*missing keys .*, .*, "):
        config_from_dict(with_backend(engine_profile=str(profile)))


def test_otlp_tls_files_must_be_pem_and_tls_alone_takes_the_system_roots(tmp_path: Path) -> None:
    not_pem = tmp_path / "ca.der"
    not_pem.write_bytes(b"\x30\x82\x01\x0a")
    tls = {"otlp_endpoint": "otel:4317", "otlp_tls": True}
    with pytest.raises(ConfigError, match=r"telemetry.otlp_ca_file: .*ca.der' is not a PEM file"):
        config_from_dict(with_key("telemetry", **tls, otlp_ca_file=str(not_pem)))
    assert config_from_dict(with_key("telemetry", **tls)).telemetry.otlp_ca_file == ""


def with_kv(address: str = OK["address"], **kv: Any) -> dict[str, Any]:
    return {"backends": [{**OK, "address": address, "kv_events": kv}]}


# KV events: the router's side of the stream is kv_events.mode, never guessed from the host
KV_CASES = [
    (with_kv(endpoint="http://engine:5557"), r"backends\[0\].kv_events.endpoint: expected tcp://"),
    (with_kv(endpoint="engine:5557"), r"backends\[0\].kv_events.endpoint: expected tcp://"),
    (with_kv(endpoint="tcp://engine"), r"backends\[0\].kv_events.endpoint: .*a port after"),
    (with_kv(endpoint="tcp://engine:0"), r"backends\[0\].kv_events.endpoint: port 0 is out of"),
    (with_kv(endpoint="tcp://en gine:5557"), r"backends\[0\].kv_events.endpoint: .*spaces"),
    (with_kv(endpoint="tcp://*:5557", mode="sub"), r"backends\[0\].kv_events.mode: expected"),
    (
        with_kv(endpoint="tcp://0.0.0.0:5557"),
        r"backends\[0\].kv_events.endpoint: .*no host to connect to.*mode: bind",
    ),
    (
        with_kv("0.0.0.0:8000", endpoint="tcp://*:5557"),
        r"backends\[0\].kv_events.endpoint: `\*` connects to the host of address",
    ),
    (
        with_kv(endpoint="tcp://10.0.0.1:5557", mode="bind", replay_endpoint="tcp://[::]:5558"),
        r"backends\[0\].kv_events.replay_endpoint: .*no host to connect to",
    ),
    (with_kv(replay_endpoint="tcp://*:5558"), r"backends\[0\].kv_events.replay_endpoint: set"),
    (
        with_kv(endpoint="tcp://*:5557", replay_endpoint="tcp://10.0.0.1:5558", dp_ranks=2),
        r"backends\[0\].kv_events.replay_endpoint: the same host and port as endpoint",
    ),
    (
        {
            "backends": [
                {**OK, "kv_events": {"endpoint": "tcp://*:5557", "mode": "bind", "dp_ranks": 2}},
                {
                    "id": "b",
                    "address": "10.0.0.2:8000",
                    "kv_events": {"endpoint": "tcp://10.9.9.9:5558", "mode": "bind"},
                },
            ]
        },
        r"backends\[1\].kv_events.endpoint: backends\[0\] binds the same port",
    ),
]


@pytest.mark.parametrize(("raw", "error"), KV_CASES, ids=[c[1][25:65] for c in KV_CASES])
def test_a_bad_kv_events_source_gets_one_clear_error(raw: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        config_from_dict(raw)


def test_kv_events_endpoints_that_load() -> None:
    def kv(**keys: Any) -> Any:
        return config_from_dict(with_kv(**keys)).backends[0].kv_events

    assert kv(endpoint="tcp://engine-a:5557").mode == "connect"  # its own host and port
    assert kv(endpoint="tcp://[fd00::1]:5557", replay_endpoint="tcp://*:5558").dp_ranks == 1
    assert kv(endpoint="tcp://*:5557", mode="bind").mode == "bind"  # every interface
    # two backends connecting to one host on their own ports, binding distinct ports
    two = [
        {**OK, "kv_events": {"endpoint": "tcp://10.0.0.1:5557", "mode": "bind"}},
        {"id": "b", "address": "10.0.0.2:8000", "kv_events": {"endpoint": "tcp://*:5558"}},
        {"id": "c", "address": "10.0.0.3:8000", "kv_events": {"endpoint": "tcp://*:5558"}},
        {"id": "d", "address": "h:1", "kv_events": {"endpoint": "tcp://*:5558", "mode": "bind"}},
    ]
    assert len(config_from_dict({"backends": two}).backends) == 4


@pytest.mark.parametrize("found", findings("config"), ids=lambda p: p.name)
def test_a_file_that_is_no_config_is_refused_with_a_config_error(
    found: Path, tmp_path: Path
) -> None:
    """Found by fuzzing (tests/fuzz/config.py): a file that is not UTF-8 raised
    UnicodeDecodeError, and keys of mixed types (`1:` beside `zz:`, or null) raised
    TypeError, where every bad file is a ConfigError naming the file. Each file is the
    file's text after one byte (a fuzz input of the target's text mode)."""
    path = tmp_path / "gorgo.yaml"
    path.write_bytes(found.read_bytes()[1:])
    with pytest.raises(ConfigError, match=f"^{path}: "):
        read_config(path)
