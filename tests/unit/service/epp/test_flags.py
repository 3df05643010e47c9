"""`gorgo epp` takes the inference extension's chart's command line as the chart writes
it, and makes the router's config from it."""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from ext_proc.config.load import config_from_dict
from ext_proc.config.transport import EnvoyMode
from ext_proc.service.epp.flags import EppOptions, add_epp_arguments, config_dict, epp_options
from ext_proc.vocab.backend import EngineKind
from ext_proc.vocab.params import ConfigError

# What the v1.5 chart's Deployment passes for an SGLang pool, with values.yaml's flags
# (`--v "1"`) and the tracing and auth switches.
CHART_ARGS = [
    "--pool-name",
    "llama",
    "--pool-namespace",
    "serving",
    "--pool-group",
    "inference.networking.k8s.io",
    '--total-queued-requests-metric="sglang:num_queue_reqs"',
    '--total-running-requests-metric="sglang:num_running_reqs"',
    '--kv-cache-usage-percentage-metric="sglang:token_usage"',
    '--cache-info-metric="sglang:cache_config_info"',
    "--zap-encoder",
    "json",
    "--config-file",
    "/config/default-plugins.yaml",
    "--v",
    "1",
    "--tracing=false",
    "--metrics-endpoint-auth=false",
]


def parse(argv: list[str]) -> EppOptions:
    p = argparse.ArgumentParser()
    add_epp_arguments(p)
    args, unknown = p.parse_known_args(argv)
    return epp_options(args, unknown)


def test_the_charts_command_line_is_taken_as_written() -> None:
    o = parse(CHART_ARGS)
    assert (o.pool_name, o.pool_namespace, o.config_file) == (
        "llama",
        "serving",
        "/config/default-plugins.yaml",
    )
    assert (o.grpc_port, o.grpc_health_port, o.metrics_port) == (9002, 9003, 9090)
    assert o.secure_serving and not o.tracing
    assert o.zap_encoder == "json" and o.verbosity == 1
    assert o.engine is EngineKind.SGLANG  # the chart's SGLang metric names say so
    assert o.ignored == ["--cache-info-metric", "--metrics-endpoint-auth"]


def test_go_flag_spellings_one_dash_equals_and_bare_booleans() -> None:
    o = parse(
        [
            "-endpoint-selector=app=vllm,env=prod",
            "-endpoint-target-ports",
            "8000,8001",
            "--secure-serving",
            "false",
            "--disable-endpoint-subset-filter",
            "--ha-enable-leader-election",
            "--some-future-flag=3",
        ]
    )
    assert o.endpoint_selector == "app=vllm,env=prod"
    assert o.endpoint_target_ports == (8000, 8001)
    assert not o.secure_serving and o.disable_endpoint_subset_filter
    assert o.ignored == ["--some-future-flag=3"]
    assert o.leader_election  # a bare boolean: the chart's spelling
    kube = config_dict(replace(o, pool_name="p", endpoint_selector=""))["discovery"]["kubernetes"]
    assert kube["leader_election"] == {"enabled": True}


def test_a_bad_boolean_is_an_error_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--pool-name", "p", "--tracing=maybe"])
    assert "--tracing" in capsys.readouterr().err


def test_the_config_is_endpoint_picker_mode_on_the_charts_ports_with_the_pool() -> None:
    cfg = config_from_dict(config_dict(parse(CHART_ARGS[:6])))
    assert cfg.envoy.mode is EnvoyMode.ENDPOINT_PICKER
    assert (cfg.listen.grpc, cfg.listen.admin) == ("0.0.0.0:9002", "0.0.0.0:9090")
    k8s = cfg.discovery.kubernetes
    assert (k8s.pool_name, k8s.namespace) == ("llama", "serving")
    assert cfg.backends == () and cfg.discovery.backend.engine is EngineKind.VLLM


def test_the_charts_own_plugins_file_means_gorgos_defaults(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plugins = tmp_path / "default-plugins.yaml"
    plugins.write_text(
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
        "plugins:\n- type: prefix-cache-scorer\n"
    )
    with caplog.at_level(logging.WARNING, "gorgo.epp"):
        raw = config_dict(parse(["--pool-name", "p", "--config-file", str(plugins)]))
    assert "EndpointPickerConfig" in caplog.text
    cfg = config_from_dict(raw)
    assert cfg.policy == "gorgo" and cfg.discovery.kubernetes.pool_name == "p"


def test_a_gorgo_config_file_is_kept_under_the_flags(tmp_path: Path) -> None:
    f = tmp_path / "gorgo.yaml"
    f.write_text(
        "policy: least_request\n"
        "discovery:\n  backend:\n    engine: sglang\n    region: us-east\n"
        "listen:\n  admin_token: s3cret\n"
    )
    o = parse(["--pool-name", "p", "--config-file", str(f), "--grpc-port", "19002"])
    o.engine = EngineKind.VLLM  # a flag's hint does not override the file's engine
    cfg = config_from_dict(config_dict(o))
    assert cfg.policy == "least_request" and cfg.listen.admin_token == "s3cret"
    assert cfg.listen.grpc == "0.0.0.0:19002"
    assert cfg.discovery.backend.engine is EngineKind.SGLANG
    assert cfg.discovery.backend.region == "us-east"


@pytest.mark.parametrize(
    "argv, error",
    [
        ([], "--pool-name or --endpoint-selector is required"),
        (["--pool-name", "p", "--endpoint-selector", "a=b"], "not both"),
        (["--endpoint-selector", "a=b"], "1 to 8 ports"),
        (["--endpoint-selector", "a b", "--endpoint-target-ports", "1"], "key=value"),
        (["--pool-name", "p", "--config-file", "/nonexistent/x.yaml"], "cannot read"),
    ],
)
def test_bad_command_lines_are_errors_naming_the_flag(argv: list[str], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        config_from_dict(config_dict(parse(argv)))
