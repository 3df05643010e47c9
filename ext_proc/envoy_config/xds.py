"""The backend clusters as filesystem xDS, so Envoy follows fleet changes without a restart.

With `envoy.xds_dir` set, the generated bootstrap (ext_proc/envoy_config/bootstrap.py) names
`<xds_dir>/cds.yaml`, and `write_xds` keeps it and each cluster's endpoint file
(`eds-<cluster>.yaml`) equal to the router's backend list. Every file is replaced by a
rename (Envoy reloads a path when a file is moved onto it; it would not see a write in
place, and a rename is never half read).

Why EDS: Envoy replaces a cluster whose definition changed and drops its connection pool
(measured on Envoy 1.40: the next request opened a new upstream connection, one more WAN
round trip on its first token), though requests in flight on the old cluster finish. The
cluster definitions here do not depend on the other backends, so adding or removing a
backend changes only endpoint files, and the backends that stay keep their connections.
A backend addressed by a DNS name cannot be an EDS endpoint (EDS does not resolve names):
a cluster holding one is a STRICT_DNS cluster inside the CDS file, replaced when it changes.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml

from ext_proc.common.files import write_atomic
from ext_proc.config.schema import Config
from ext_proc.envoy_config.clusters import (
    CDS_FILE,
    POOL_CLUSTER,
    backend_clusters,
    eds_file,
    file_config_source,
    xds_path,
)
from ext_proc.vocab.params import split_host_port

_CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
_ASSIGNMENT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def _discovery_response(resources: list[dict[str, Any]]) -> str:
    """A DiscoveryResponse as Envoy's filesystem subscription reads it. The version is the
    content's hash: the same fleet gives the same file (Envoy skips unchanged clusters),
    and Envoy's config_dump shows which file it applied."""
    digest = hashlib.sha256(json.dumps(resources, sort_keys=True).encode()).hexdigest()[:16]
    return yaml.safe_dump(
        {"version_info": digest, "resources": resources}, sort_keys=False, width=100
    )


def xds_files(cfg: Config, draining: Collection[str] = ()) -> dict[str, str]:
    """File name -> text for `cfg.backends` (active and draining; see backend_clusters
    for what draining changes)."""
    files: dict[str, str] = {}
    clusters: list[dict[str, Any]] = []
    for c in backend_clusters(cfg, draining):
        if c["type"] != "STATIC":  # a DNS name: inline, Envoy resolves it
            clusters.append({"@type": _CLUSTER_TYPE, **c})
            continue
        assignment = c.pop("load_assignment")
        name = eds_file(c["name"])
        files[name] = _discovery_response([{"@type": _ASSIGNMENT_TYPE, **assignment}])
        c["type"] = "EDS"
        c["eds_cluster_config"] = {"eds_config": file_config_source(xds_path(cfg, name))}
        clusters.append({"@type": _CLUSTER_TYPE, **c})
    # Last in the dict, so write_xds renames it last: every endpoint file it names exists.
    files[CDS_FILE] = _discovery_response(clusters)
    return files


def write_xds(cfg: Config, draining: Collection[str] = ()) -> None:
    """Make the files in `envoy.xds_dir` describe `cfg.backends` (no-op when it is "").

    Order: endpoint files first, then the CDS file that names them, then stale endpoint
    files go (their clusters have left the CDS file). An unchanged file is not rewritten,
    so Envoy sees no update for it."""
    if not cfg.envoy.xds_dir:
        return
    root = Path(cfg.envoy.xds_dir)
    root.mkdir(parents=True, exist_ok=True)
    files = xds_files(cfg, draining)
    for name, text in files.items():
        path = root / name
        try:
            if path.read_text(encoding="utf-8") == text:
                continue
        except FileNotFoundError:
            pass
        write_atomic(path, text)
    for stale in root.glob(eds_file("*")):
        if stale.name not in files:
            stale.unlink(missing_ok=True)


def routable_lines(cfg: Config, draining: Collection[str] = ()) -> dict[str, str]:
    """Backend id -> a line prefix Envoy's admin /clusters shows once a decision naming that
    backend can be served: its own cluster with its endpoint (cluster mode), or its
    endpoint in the pool (endpoint_picker). Draining backends are not awaited. A backend
    addressed by a DNS name shows its resolved address, so only its cluster is awaited."""
    out: dict[str, str] = {}
    picker = cfg.envoy.mode == "endpoint_picker"
    for b in cfg.backends:
        if b.id in draining:
            continue
        cluster = POOL_CLUSTER if picker else b.id
        host, port = split_host_port(b.address, f"backend {b.id}")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            out[b.id] = f"{cluster}::"
            continue
        out[b.id] = (
            f"{cluster}::{ip}:{port}::" if ip.version == 4 else f"{cluster}::[{ip}]:{port}::"
        )
    return out


def missing_in(clusters_text: str, cfg: Config, draining: Collection[str] = ()) -> list[str]:
    """The backends of `cfg` that Envoy's /clusters text does not show as routable."""
    lines = clusters_text.splitlines()
    return [
        bid
        for bid, prefix in routable_lines(cfg, draining).items()
        if not any(line.startswith(prefix) for line in lines)
    ]


def _admin_url(cfg: Config) -> str:
    host, port = split_host_port(cfg.envoy.admin, "envoy.admin")
    if host in ("0.0.0.0", "::", ""):  # Envoy listens everywhere: ask it here
        host = "127.0.0.1"
    return f"http://[{host}]:{port}/clusters" if ":" in host else f"http://{host}:{port}/clusters"


async def wait_envoy(
    cfg: Config, draining: Collection[str] = (), timeout_s: float = 5.0
) -> list[str]:
    """After write_xds: wait until Envoy (its admin `envoy.admin`) can route to every
    backend of `cfg` that is not draining. Returns the ones still missing at the timeout
    ([] = all there). With xds_dir "" the clusters are not ours (static, or a mesh's own
    control plane): they are still confirmed when Envoy's admin answers, so a backend
    whose cluster Envoy lacks stays pending instead of drawing 503s; if the admin is out
    of reach there is nothing to confirm with, and [] comes at once."""
    import aiohttp

    url = _admin_url(cfg)
    deadline = time.monotonic() + timeout_s
    missing = [b.id for b in cfg.backends if b.id not in draining]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
        while True:
            try:
                async with session.get(url) as r:
                    missing = missing_in(await r.text(), cfg, draining)
            except (aiohttp.ClientError, TimeoutError):
                if not cfg.envoy.xds_dir:
                    return []
            if not missing or time.monotonic() >= deadline:
                return missing
            await asyncio.sleep(0.02)


__all__ = ["missing_in", "wait_envoy", "write_xds", "xds_files"]
