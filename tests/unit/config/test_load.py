from pathlib import Path

import pytest
import yaml

from emulator.stack.settings import StackSettings
from ext_proc.config.dump import config_as_dict
from ext_proc.config.load import config_from_dict, load_config
from ext_proc.config.transport import EnvoyMode
from ext_proc.envoy_config.bootstrap import build_envoy_config, render_envoy_config
from ext_proc.policy.catalog import policy_params
from ext_proc.vocab.params import ConfigError

ROOT = Path(__file__).resolve().parents[3]
BACKEND = {"id": "a", "address": "127.0.0.1:1"}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, "backends: at least one backend is required"),
        ({"backends": []}, "backends: at least one backend"),
        ({"backends": [BACKEND], "polcy": "x"}, "polcy: unknown key"),
        ({"backends": [BACKEND], "policy": "nope"}, "policy: unknown policy 'nope'"),
        ({"backends": [BACKEND], "envoy": {"max_body_bytes": "big"}}, "envoy.max_body_bytes"),
        ({"backends": [BACKEND], "envoy": {"message_timeout_ms": 0}}, "message_timeout_ms"),
        ({"backends": [BACKEND], "listen": {"grpc": "nohost"}}, "listen.grpc: expected host:port"),
        ({"backends": [{"id": "a"}]}, r"backends\[0\].address: required"),
        ({"backends": [{"id": "A b", "address": "h:1"}]}, r"backends\[0\].id"),
        ({"backends": [BACKEND, BACKEND]}, r"backends\[1\].id: duplicate"),
        ({"backends": [{**BACKEND, "rtt_prior_ms": True}]}, "rtt_prior_ms: expected a number"),
        ({"backends": "a"}, "backends: expected a list"),
        ({"backends": [BACKEND], "envoy": {"connect_retries": -1}}, "envoy.connect_retries"),
        ({"backends": [BACKEND], "listen": {"tls": {"cert_file": "c"}}}, "listen.tls: cert_file"),
        (
            {"backends": [BACKEND], "listen": {"tls": {"client_ca_file": "ca"}}},
            "listen.tls.client_ca_file: mTLS needs",
        ),
        (
            {"backends": [BACKEND], "envoy": {"ext_proc_tls": {"cert_file": "c", "key_file": "k"}}},
            "envoy.ext_proc_tls: cert_file and server_name need ca_file",
        ),
        (
            {"backends": [BACKEND], "listen": {"tls": {"cert_file": "c", "key_file": "k"}}},
            "envoy.ext_proc_tls.ca_file: required when listen.tls is set",
        ),
        (
            {
                "backends": [BACKEND],
                "listen": {"tls": {"cert_file": "c", "key_file": "k", "client_ca_file": "ca"}},
                "envoy": {"ext_proc_tls": {"ca_file": "ca"}},
            },
            "envoy.ext_proc_tls.cert_file: required when listen.tls.client_ca_file is set",
        ),
        (
            {"backends": [BACKEND], "routing": {"unreadable_body": "drop"}},
            "routing.unreadable_body: expected route or reject",
        ),
        ({"backends": [BACKEND], "envoy": {"mode": "x"}}, "envoy.mode: expected cluster or"),
        ({"backends": [BACKEND], "tuner": {"mode": "on"}}, "tuner.mode: expected off or paired"),
        ({"backends": [BACKEND], "tuner": {"arm_size": 3}}, "tuner.arm_size: must be >= 4"),
        ({"backends": [BACKEND], "probes": {"ewma_alpha": 2}}, "probes.ewma_alpha: must be <= 1"),
        ({"backends": [BACKEND], "probes": {"ewma_alpha": 0}}, "probes.ewma_alpha: must be > 0"),
        ({"backends": [{**BACKEND, "rtt_prior_ms": -1}]}, r"backends\[0\].rtt_prior_ms: must"),
        # keys that moved name their new place
        ({"backends": [BACKEND], "weights": {"rtt": 1}}, "weights: moved to policies.gorgo"),
        ({"backends": [BACKEND], "token_weights": {}}, "moved to policies.gorgo_tokens.weights"),
        (
            {"backends": [BACKEND], "routing": {"tie_fraction": 0.1}},
            "routing.tie_fraction: moved to policies.gorgo.tie_fraction",
        ),
        (
            {"backends": [BACKEND], "routing": {"prefix_min_fraction": 0.1}},
            "routing.prefix_min_fraction: moved to policies.prefix_cache.min_fraction",
        ),
        (
            {"backends": [BACKEND], "routing": {"refit_prefill": True}},
            "routing.refit_prefill: moved to routing.learn_latency",
        ),
        (
            {"backends": [BACKEND], "models": [{"name": "chat", "served": []}]},
            r"models\[0\].served: at least one",
        ),
        (
            {"backends": [BACKEND], "models": [{"name": "x", "served": [{"model": "y"}]}] * 2},
            r"models\[1\].name: 'x' listed twice",
        ),
        (
            {
                "backends": [BACKEND],
                "models": [{"name": "x", "served": [{"model": "y", "weight": 0}]}],
            },
            r"models\[0\].served\[0\].weight: must be > 0",
        ),
        # each policy's own parameters, decoded strictly
        ({"backends": [BACKEND], "policies": {"nope": {}}}, "policies.nope: unknown policy"),
        (
            {"backends": [BACKEND], "policies": {"gorgo": {"tie": 1}}},
            "policies.gorgo.tie: unknown key",
        ),
        (
            {"backends": [BACKEND], "policies": {"gorgo": {"weights": {"rtt": 0}}}},
            "policies.gorgo.weights.rtt: must be > 0",
        ),
        (
            {"backends": [BACKEND], "policies": {"prefix_cache": {"min_fraction": 2}}},
            "policies.prefix_cache.min_fraction: must be <= 1",
        ),
        ({"backends": [BACKEND], "policies": []}, "policies: expected a mapping"),
    ],
)
def test_bad_config_names_the_key(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_dict(raw)


def test_policy_parameters_and_a_round_trip() -> None:
    cfg = config_from_dict(
        {
            "backends": [BACKEND],
            "envoy": {"mode": "endpoint_picker"},
            "policies": {"gorgo": {"weights": {"queue": 2}}, "prefix_cache": {"balance_abs": 9}},
        }
    )
    assert cfg.envoy.mode == EnvoyMode.ENDPOINT_PICKER
    gorgo = policy_params(cfg)
    assert (gorgo.weights.rtt, gorgo.weights.queue, gorgo.tie_fraction) == (1.0, 2.0, 0.0)
    assert policy_params(cfg, "prefix_cache").balance_abs == 9
    assert policy_params(cfg, "gorgo_tokens").weights.rtt == 0.5  # not configured: defaults
    # the plain form (what `gorgo up` writes) reads back to the same config
    assert config_from_dict(yaml.safe_load(yaml.safe_dump(config_as_dict(cfg)))) == cfg


def test_load_config_reports_file_and_yaml_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends: [")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_shipped_envoy_config_is_generated_from_the_shipped_gorgo_config() -> None:
    """envoy/front-door.yaml cannot drift from config/gorgo.yaml."""
    cfg = load_config(ROOT / "config/gorgo.yaml")
    assert (ROOT / "envoy/front-door.yaml").read_text() == render_envoy_config(cfg), (
        "regenerate: gorgo envoy-config --config config/gorgo.yaml > envoy/front-door.yaml"
    )
    # and the local stack (`gorgo up`) runs exactly this fleet
    assert cfg == StackSettings().gorgo_config()


def test_envoy_config_has_one_cluster_per_backend_and_fails_open() -> None:
    cfg = load_config(ROOT / "config/gorgo.yaml")
    envoy = build_envoy_config(cfg)
    clusters = {c["name"]: c for c in envoy["static_resources"]["clusters"]}
    assert set(clusters) == {*cfg.backend_ids, "gorgo_fallback", "gorgo_ext_proc"}
    fallback = clusters["gorgo_fallback"]
    assert fallback["lb_policy"] == "LEAST_REQUEST"
    assert len(fallback["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 3
    listener = envoy["static_resources"]["listeners"][0]
    assert listener["per_connection_buffer_limit_bytes"] >= 4 * 1024 * 1024
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = hcm["http_filters"][0]["typed_config"]
    assert ext_proc["failure_mode_allow"] is True
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert routes[0]["route"]["cluster_header"] == "x-gorgo-backend"
    assert routes[0]["route"]["timeout"] == "600.0s"
    assert routes[-1]["route"]["cluster"] == "gorgo_fallback"
    # connect failures go to another backend: each backend's cluster holds the others at
    # priority 1, and a retry skips the priority it already tried
    retry = routes[0]["route"]["retry_policy"]
    # a reset before the response began is retried too (a dead engine behind a live link)
    assert retry["retry_on"] == "connect-failure,refused-stream,reset"
    assert retry["num_retries"] == 2
    assert retry["retry_priority"]["name"] == "envoy.retry_priorities.previous_priorities"
    nearest_first = [b.id for b in sorted(cfg.backends, key=lambda b: b.rtt_prior_ms)]
    for b in cfg.backends:
        priorities = clusters[b.id]["load_assignment"]["endpoints"]
        # one backend per priority: the chosen one, then the others nearest first, so each
        # retry moves on to a backend not tried yet
        order = [
            p["lb_endpoints"][0]["metadata"]["filter_metadata"]["gorgo"]["backend"]
            for p in priorities
        ]
        assert order == [b.id, *(o for o in nearest_first if o != b.id)]
        assert [p.get("priority", 0) for p in priorities] == list(range(len(cfg.backends)))
        assert all(len(p["lb_endpoints"]) == 1 for p in priorities)
    assert "retry_priority" not in routes[-1]["route"]["retry_policy"]
    stripped = {
        m["remove"] for m in hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    }
    assert stripped == {
        "x-gorgo-backend",
        "x-gateway-destination-endpoint",
        "x-gorgo-prefill-backend",
    }


def test_connect_retries_zero_means_no_retry_policy() -> None:
    cfg = config_from_dict({"backends": [BACKEND], "envoy": {"connect_retries": 0}})
    routes = build_envoy_config(cfg)["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"
    ][0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    assert all("retry_policy" not in r["route"] for r in routes)


def test_retry_resets_false_retries_only_connections_that_never_carried_the_request() -> None:
    cfg = config_from_dict({"backends": [BACKEND], "envoy": {"retry_resets": False}})
    routes = build_envoy_config(cfg)["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"
    ][0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    retry_on = {r["route"]["retry_policy"]["retry_on"] for r in routes}
    assert retry_on == {"connect-failure,refused-stream,reset-before-request"}


def test_ext_proc_tls_checks_the_server_name_and_sends_the_client_certificate() -> None:
    tls = {"ca_file": "/ca.pem", "cert_file": "/c.pem", "key_file": "/k.pem"}
    for address, san_type in (("gorgo:50051", "DNS"), ("10.0.0.7:50051", "IP_ADDRESS")):
        cfg = config_from_dict(
            {"backends": [BACKEND], "envoy": {"ext_proc_address": address, "ext_proc_tls": tls}}
        )
        clusters = {c["name"]: c for c in build_envoy_config(cfg)["static_resources"]["clusters"]}
        socket = clusters["gorgo_ext_proc"]["transport_socket"]["typed_config"]
        common = socket["common_tls_context"]
        (san,) = common["validation_context"]["match_typed_subject_alt_names"]
        host = address.split(":")[0]
        assert san == {"san_type": san_type, "matcher": {"exact": host}}
        assert socket.get("sni") == (host if san_type == "DNS" else None)
        assert common["tls_certificates"][0]["certificate_chain"] == {"filename": "/c.pem"}
    plain = config_from_dict({"backends": [BACKEND]})
    clusters = build_envoy_config(plain)["static_resources"]["clusters"]
    assert all("transport_socket" not in c for c in clusters)


def test_hostnames_make_dns_clusters() -> None:
    cfg = config_from_dict({"backends": [{"id": "a", "address": "engine-a:30000"}]})
    clusters = build_envoy_config(cfg)["static_resources"]["clusters"]
    assert clusters[0]["type"] == "STRICT_DNS"


def test_unreadable_tls_files_are_named(tmp_path: Path) -> None:
    from ext_proc.service.app import server_credentials

    missing = str(tmp_path / "nope.pem")
    cfg = config_from_dict(
        {
            "backends": [BACKEND],
            "listen": {"tls": {"cert_file": missing, "key_file": missing}},
            "envoy": {"ext_proc_tls": {"ca_file": "/ca.pem"}},
        }
    )
    with pytest.raises(OSError, match=r"listen.tls.key_file: cannot read .*nope.pem"):
        server_credentials(cfg)
    assert server_credentials(config_from_dict({"backends": [BACKEND]})) is None


def test_write_atomic_replaces_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    from ext_proc.common.files import write_atomic

    target = tmp_path / "gorgo.yaml"
    target.write_text("old")
    write_atomic(target, "new: 1\n")
    assert target.read_text() == "new: 1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["gorgo.yaml"]
