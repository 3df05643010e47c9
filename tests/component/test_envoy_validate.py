"""Envoy accepts what gorgo generates and ships, by `envoy --mode validate` (which resolves
no DNS, so STRICT_DNS host names pass): the bootstrap from config/gorgo.yaml, the one
`gorgo envoy-config` writes beside its xDS files, the shipped compose and endpoint-picker
configs, and the mesh snippet pasted into an existing Envoy config as docs/envoy.md says."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from emulator.engine.tokenizer import tiny_tokenizer_dir
from emulator.stack.processes import envoy_binary
from ext_proc.cli import main
from ext_proc.config.load import load_config
from ext_proc.config.schema import TunerMode
from ext_proc.envoy_config.bootstrap import render_envoy_config
from ext_proc.vocab.backend import EngineKind
from tests.certs import Ca
from tests.xds_configs import BACKENDS, cfg_of

ROOT = Path(__file__).resolve().parents[2]


# -- what gorgo generates --------------------------------------------------------------------


def test_real_envoy_accepts_the_generated_config(tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(render_envoy_config(load_config(ROOT / "config/gorgo.yaml")))
    assert "OK" in _validate(path)
    assert yaml.safe_load(path.read_text())["admin"]


def test_envoy_config_writes_the_files_and_envoy_accepts_the_bootstrap(tmp_path: Path) -> None:
    config = tmp_path / "gorgo.yaml"
    xds = str(tmp_path / "xds")
    config.write_text(yaml.safe_dump({"backends": BACKENDS, "envoy": {"xds_dir": xds}}))
    out = tmp_path / "envoy.yaml"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["envoy-config", "--config", str(config)]) == 0
    out.write_text(buf.getvalue())
    assert (tmp_path / "xds/cds.yaml").exists()
    assert buf.getvalue() == render_envoy_config(cfg_of(tmp_path / "xds"))
    checked = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(out), "--disable-hot-restart"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


# -- what the repository ships ---------------------------------------------------------------


def _paste_snippet(snippet: dict[str, Any]) -> dict[str, Any]:
    """An Envoy that already serves a web app, with the snippet pasted in as docs/envoy.md
    says: listener limit, HCM fields, filters before the router, routes and response
    header on the LLM virtual host, clusters."""
    hcm_type = (
        "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
        ".HttpConnectionManager"
    )
    web_host = {"socket_address": {"address": "127.0.0.1", "port_value": 18081}}
    llm_vhost: dict[str, Any] = {"name": "llm", "domains": ["llm.example.com"], "routes": []}
    hcm: dict[str, Any] = {
        "@type": hcm_type,
        "stat_prefix": "ingress",
        "route_config": {
            "name": "ingress",
            "virtual_hosts": [
                llm_vhost,
                {
                    "name": "web",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "web"}}],
                },
            ],
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }
        ],
    }
    listener: dict[str, Any] = {
        "name": "ingress",
        "address": {"socket_address": {"address": "0.0.0.0", "port_value": 18080}},
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager",
                          "typed_config": hcm}]}
        ],
    }  # fmt: skip
    clusters: list[dict[str, Any]] = [
        {
            "name": "web",
            "type": "STATIC",
            "load_assignment": {
                "cluster_name": "web",
                "endpoints": [{"lb_endpoints": [{"endpoint": {"address": web_host}}]}],
            },
        }
    ]
    # the steps
    listener["per_connection_buffer_limit_bytes"] = snippet["per_connection_buffer_limit_bytes"]
    hcm["early_header_mutation_extensions"] = snippet["early_header_mutation_extensions"]
    hcm["access_log"] = snippet["access_log"]
    hcm["http_filters"][:0] = snippet["http_filters"]
    llm_vhost["routes"] = snippet["routes"]
    llm_vhost["response_headers_to_add"] = snippet["response_headers_to_add"]
    clusters += snippet["clusters"]
    return {"static_resources": {"listeners": [listener], "clusters": clusters}}


def _validate(path: Path) -> str:
    """Envoy accepts the config at path, without deprecation warnings; its output."""
    out = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "deprecated" not in (out.stdout + out.stderr).lower()
    return out.stdout


@pytest.mark.parametrize("path", ["envoy/compose/envoy.yaml", "envoy/mesh/endpoint-picker.yaml"])
def test_real_envoy_accepts_the_shipped_config(path: str) -> None:
    """Host names (STRICT_DNS clusters: wan-us-ashburn, gorgo, jaeger) are not resolved by
    validate mode, so the compose config validates outside Docker."""
    _validate(ROOT / path)


def test_real_envoy_accepts_the_snippet_pasted_into_an_existing_config(tmp_path: Path) -> None:
    snippet = yaml.safe_load((ROOT / "envoy/mesh/gorgo-filters.yaml").read_text())
    path = tmp_path / "existing-envoy.yaml"
    path.write_text(yaml.safe_dump(_paste_snippet(snippet), sort_keys=False))
    _validate(path)


# -- the README's own-fleet config -----------------------------------------------------------


def readme_fleet_yaml() -> str:
    """The YAML block of the README's "Put it in front of your fleet" section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Put it in front of your fleet", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None, "the section has no yaml block"
    return block.group(1)


def test_the_readme_fleet_config_loads_and_envoy_accepts_what_it_generates(
    tmp_path: Path,
) -> None:
    # The files it names, made real: the TLS material and the engines' tokenizer.
    ca = Ca(tmp_path)
    router, envoy = ca.issue("router", dns="gorgo.internal"), ca.issue("envoy")
    tokenizer = tiny_tokenizer_dir()
    files = {
        "/etc/gorgo/tls/ca.crt": ca.pem.cert,
        "/etc/gorgo/tls/router.crt": router.cert,
        "/etc/gorgo/tls/router.key": router.key,
        "/etc/gorgo/tls/envoy.crt": envoy.cert,
        "/etc/gorgo/tls/envoy.key": envoy.key,
        "/models/Llama-3.1-8B-Instruct/tokenizer.json": tokenizer / "tokenizer.json",
    }
    text = readme_fleet_yaml()
    for name, path in files.items():
        text = text.replace(name, str(path))
    assert not re.search(r"/etc/|/models/", text), "a file the config names is not provided"
    config = tmp_path / "gorgo.yaml"
    config.write_text(text)

    cfg = load_config(config)
    assert [b.engine for b in cfg.backends] == [EngineKind.VLLM, EngineKind.VLLM, EngineKind.SGLANG]
    assert all(b.kv_events.endpoint and b.kv_capacity_tokens for b in cfg.backends)
    assert cfg.listen.tls.client_ca_file and cfg.envoy.ext_proc_tls.cert_file
    assert cfg.listen.admin_token and cfg.telemetry.otlp_endpoint and cfg.envoy.tracing_endpoint
    assert cfg.tuner.mode == TunerMode.OFF  # the default

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["envoy-config", "--config", str(config)]) == 0
    out = tmp_path / "envoy.yaml"
    out.write_text(buf.getvalue())
    assert "OK" in _validate(out)
    clusters = {c["name"] for c in yaml.safe_load(buf.getvalue())["static_resources"]["clusters"]}
    assert {"us-east", "eu-west", "ap-northeast"} <= clusters
