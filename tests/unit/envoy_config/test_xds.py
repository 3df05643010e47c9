"""envoy.xds_dir: the bootstrap names the CDS file, write_xds keeps the files equal to the
backend list (atomically, untouched when unchanged), and draining backends get no new
work from Envoy. Envoy itself following the files, and wait_envoy against an admin that
answers: tests/component/test_xds_envoy.py; Envoy accepting the bootstrap:
tests/component/test_envoy_validate.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ext_proc.config.load import config_from_dict
from ext_proc.envoy_config.bootstrap import build_envoy_config, build_mesh_snippet
from ext_proc.envoy_config.xds import missing_in, write_xds, xds_files
from ext_proc.vocab.params import ConfigError
from tests.xds_configs import BACKENDS, cfg_of


def load(path: Path) -> list[dict[str, Any]]:
    resources: list[dict[str, Any]] = yaml.safe_load(path.read_text())["resources"]
    return resources


def order(assignment: dict[str, Any]) -> list[list[str]]:
    """The backends of each priority of a ClusterLoadAssignment, priority 0 first."""
    return [
        [e["metadata"]["filter_metadata"]["gorgo"]["backend"] for e in p["lb_endpoints"]]
        for p in sorted(assignment["endpoints"], key=lambda p: p.get("priority", 0))
    ]


def test_no_xds_dir_writes_nothing_and_keeps_static_clusters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config_from_dict({"backends": BACKENDS})
    monkeypatch.chdir(tmp_path)
    write_xds(cfg)
    assert list(tmp_path.iterdir()) == []
    envoy = build_envoy_config(cfg)
    assert "dynamic_resources" not in envoy
    # a node id all the same: the access log names the Envoy whose requests it reports
    assert envoy["node"]["id"] == "gorgo-front-door@127.0.0.1:10000"
    names = {c["name"] for c in envoy["static_resources"]["clusters"]}
    assert names == {"near", "mid", "far", "gorgo_fallback", "gorgo_ext_proc"}


def test_the_bootstrap_reads_the_backend_clusters_from_the_cds_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = cfg_of("rel/xds")
    monkeypatch.chdir(tmp_path)
    envoy = build_envoy_config(cfg)
    cds = envoy["dynamic_resources"]["cds_config"]
    # absolute, so Envoy and the router agree whatever their working directories
    assert cds["path_config_source"]["path"] == str(tmp_path / "rel/xds/cds.yaml")
    assert cds["resource_api_version"] == "V3"
    assert envoy["node"]["id"] and envoy["node"]["cluster"]
    # only the router's own clusters stay static
    assert [c["name"] for c in envoy["static_resources"]["clusters"]] == ["gorgo_ext_proc"]
    route = envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]["route_config"]
    assert route["validate_clusters"] is False  # gorgo_fallback arrives by CDS


def test_each_cluster_is_eds_with_the_others_as_standby(tmp_path: Path) -> None:
    cfg = cfg_of(tmp_path)
    write_xds(cfg)
    clusters = {c["name"]: c for c in load(tmp_path / "cds.yaml")}
    assert set(clusters) == {"near", "mid", "far", "gorgo_fallback"}
    for name, c in clusters.items():
        assert c["@type"] == "type.googleapis.com/envoy.config.cluster.v3.Cluster"
        assert c["type"] == "EDS" and "load_assignment" not in c
        path = c["eds_cluster_config"]["eds_config"]["path_config_source"]["path"]
        assert path == str(tmp_path / f"eds-{name}.yaml")
        (assignment,) = load(Path(path))
        assert assignment["cluster_name"] == name
        assert assignment["@type"].endswith("envoy.config.endpoint.v3.ClusterLoadAssignment")
    assert clusters["gorgo_fallback"]["lb_policy"] == "LEAST_REQUEST"
    (mid,) = load(tmp_path / "eds-mid.yaml")
    assert order(mid) == [["mid"], ["near"], ["far"]]
    (fallback,) = load(tmp_path / "eds-gorgo_fallback.yaml")
    assert order(fallback) == [["near", "mid", "far"]]
    # the endpoints are the static build's, moved
    static = {c["name"]: c for c in build_envoy_config(cfg_of(""))["static_resources"]["clusters"]}
    assert mid["endpoints"] == static["mid"]["load_assignment"]["endpoints"]


def test_a_cluster_definition_does_not_depend_on_the_other_backends(tmp_path: Path) -> None:
    """So adding or removing a backend changes endpoint files only: Envoy keeps the other
    clusters (and their connections)."""
    cds = yaml.safe_load(xds_files(cfg_of(tmp_path))["cds.yaml"])
    before = {c["name"]: c for c in cds["resources"]}
    more = [*BACKENDS, {"id": "new", "address": "10.0.0.4:8000", "rtt_prior_ms": 20}]
    files = xds_files(cfg_of(tmp_path, more))
    after = {c["name"]: c for c in yaml.safe_load(files["cds.yaml"])["resources"]}
    assert set(after) == {*before, "new"}
    assert all(after[n] == before[n] for n in before)
    (near,) = yaml.safe_load(files["eds-near.yaml"])["resources"]
    assert order(near) == [["near"], ["new"], ["mid"], ["far"]]


def test_rewrites_are_renames_and_unchanged_files_stay(tmp_path: Path) -> None:
    write_xds(cfg_of(tmp_path))
    inodes = {p.name: p.stat().st_ino for p in tmp_path.iterdir()}
    write_xds(cfg_of(tmp_path))  # same fleet: no file replaced (Envoy sees no update)
    assert {p.name: p.stat().st_ino for p in tmp_path.iterdir()} == inodes
    more = [*BACKENDS, {"id": "new", "address": "10.0.0.4:8000", "rtt_prior_ms": 20}]
    write_xds(cfg_of(tmp_path, more))
    now = {p.name: p.stat().st_ino for p in tmp_path.iterdir()}
    assert set(now) == {*inodes, "eds-new.yaml"}  # no temporary file left behind
    assert all(now[n] != inodes[n] for n in inodes)  # each replaced by a rename, not in place
    write_xds(cfg_of(tmp_path, BACKENDS[:2]))  # far removed: its endpoint file goes
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "cds.yaml", "eds-gorgo_fallback.yaml", "eds-mid.yaml", "eds-near.yaml",
    ]  # fmt: skip


def test_a_draining_backend_keeps_its_cluster_but_gets_no_new_work(tmp_path: Path) -> None:
    write_xds(cfg_of(tmp_path), draining={"near"})
    assert {c["name"] for c in load(tmp_path / "cds.yaml")} == {
        "near", "mid", "far", "gorgo_fallback",
    }  # fmt: skip
    (near,) = load(tmp_path / "eds-near.yaml")
    assert order(near) == [["near"], ["mid"], ["far"]]  # a decision just before still works
    (mid,) = load(tmp_path / "eds-mid.yaml")
    assert order(mid) == [["mid"], ["far"]]  # no retries onto it
    (fallback,) = load(tmp_path / "eds-gorgo_fallback.yaml")
    assert order(fallback) == [["mid", "far"]]  # no fail-open requests onto it
    # all draining: the fallback keeps them rather than serving nothing
    write_xds(cfg_of(tmp_path), draining={"near", "mid", "far"})
    (fallback,) = load(tmp_path / "eds-gorgo_fallback.yaml")
    assert order(fallback) == [["near", "mid", "far"]]


def test_a_dns_backend_makes_inline_dns_clusters(tmp_path: Path) -> None:
    """EDS endpoints are addresses, never names: a cluster with a host name is STRICT_DNS
    in the CDS file (Envoy resolves it)."""
    dns = [*BACKENDS[:2], {"id": "named", "address": "engine-c:30000", "rtt_prior_ms": 9}]
    write_xds(cfg_of(tmp_path, dns))
    clusters = {c["name"]: c for c in load(tmp_path / "cds.yaml")}
    assert clusters["named"]["type"] == "STRICT_DNS"
    assert clusters["named"]["load_assignment"]["cluster_name"] == "named"
    assert clusters["near"]["type"] == "STRICT_DNS"  # named is its standby
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cds.yaml"]


def test_endpoint_picker_pool_is_eds(tmp_path: Path) -> None:
    cfg = cfg_of(tmp_path, mode="endpoint_picker")
    write_xds(cfg, draining={"far"})
    (pool,) = load(tmp_path / "cds.yaml")
    assert pool["name"] == "gorgo_pool" and pool["type"] == "EDS"
    policy = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    (assignment,) = load(tmp_path / "eds-gorgo_pool.yaml")
    assert order(assignment) == [["near", "mid"]]


def test_missing_in_reads_envoys_clusters_listing() -> None:
    cfg = cfg_of("/x")
    text = "\n".join(
        [
            "near::observability_name::near",
            "near::10.0.0.1:8000::priority::0",
            "mid::observability_name::mid",  # listed, but its endpoint not yet
            "gorgo_fallback::10.0.0.2:8000::priority::0",
        ]
    )
    assert missing_in(text, cfg) == ["mid", "far"]
    assert missing_in(text, cfg, draining={"mid", "far"}) == []
    picker = cfg_of("/x", mode="endpoint_picker")
    assert missing_in("gorgo_pool::10.0.0.3:8000::priority::0\n", picker) == ["near", "mid"]
    named = cfg_of("/x", [{"id": "n", "address": "engine-n:1"}])
    assert missing_in("n::10.9.9.9:1::priority::0\n", named) == []


def test_the_mesh_snippet_keeps_the_clusters_in_full(tmp_path: Path) -> None:
    snippet = build_mesh_snippet(cfg_of(tmp_path))
    assert {c["name"] for c in snippet["clusters"]} >= {"near", "gorgo_fallback"}


def test_several_routers_are_one_ext_proc_cluster_and_need_nats() -> None:
    two = ["127.0.0.1:50051", "127.0.0.1:50052"]
    raw = {"backends": BACKENDS, "envoy": {"ext_proc_addresses": two}}
    with pytest.raises(ConfigError, match=r"envoy.ext_proc_addresses: 2 routers .* bus.nats_url"):
        build_envoy_config(config_from_dict(raw))
    cfg = config_from_dict({**raw, "bus": {"nats_url": "nats://127.0.0.1:4222"}})
    (cluster,) = [
        c
        for c in build_envoy_config(cfg)["static_resources"]["clusters"]
        if c["name"] == "gorgo_ext_proc"
    ]
    endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"] for e in endpoints]
    assert ports == [50051, 50052] and cfg.ext_proc_address == two[0]
