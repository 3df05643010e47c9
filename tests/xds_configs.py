"""The fleet the envoy.xds_dir tests write files for (three regions 1 / 50 / 150 ms away, on
10.0.0.x) and its config with an xds_dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ext_proc.config.load import config_from_dict
from ext_proc.config.schema import Config

BACKENDS = [
    {"id": "near", "address": "10.0.0.1:8000", "rtt_prior_ms": 1},
    {"id": "mid", "address": "10.0.0.2:8000", "rtt_prior_ms": 50},
    {"id": "far", "address": "10.0.0.3:8000", "rtt_prior_ms": 150},
]


def cfg_of(xds_dir: Path | str, backends: list[dict[str, Any]] = BACKENDS, **envoy: Any) -> Config:
    return config_from_dict({"backends": backends, "envoy": {"xds_dir": str(xds_dir), **envoy}})
