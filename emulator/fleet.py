"""Fleet files: which engine profile each region's engine really runs (the engines' truth,
for `gorgo simulate --fleet` and `gorgo up --fleet`), apart from what the router is told.

    backends:
      - id: us-ashburn
        engine_profile: l40s-qwen3.5-35b-a3b-fp8   # a built-in profile
      - id: eu-frankfurt
        engine_profile: fast.yaml                  # a file, relative to this one

A region the file does not list runs the default profile.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ext_proc.estimate.profile import load_profile

_BACKEND_KEYS = ("id", "engine_profile")


@dataclass(frozen=True)
class Fleet:
    # Where it was read from ("" for none), for result files and messages.
    path: str = ""
    # Region id -> engine profile (a built-in name, or a YAML path resolved beside the file).
    profiles: Mapping[str, str] = field(default_factory=dict)

    def profile_of(self, region: str, default: str) -> str:
        return self.profiles.get(region, default)


NO_FLEET = Fleet()


def load_fleet(path: str | Path, regions: Sequence[str]) -> Fleet:
    """Read and check a fleet file: every id one of `regions`, once; every profile loads.
    Raises ValueError naming the file and the bad key."""
    where = f"fleet {path}"
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"{where}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ValueError(f"{where}: not YAML ({e})") from e
    return fleet_from_dict(raw, regions, str(path))


def fleet_from_dict(raw: Any, regions: Sequence[str], path: str = "") -> Fleet:
    where = f"fleet {path}" if path else "fleet"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping with `backends:`")
    unknown = sorted(set(raw) - {"backends"})
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (expected `backends`)")
    backends = raw.get("backends")
    if not isinstance(backends, list) or not backends:
        raise ValueError(f"{where}: backends: expected a non-empty list")
    base = Path(path).parent if path else Path(".")
    profiles: dict[str, str] = {}
    for i, b in enumerate(backends):
        key = f"{where}: backends[{i}]"
        if not isinstance(b, dict):
            raise ValueError(f"{key}: expected a mapping with id and engine_profile")
        unknown = sorted(set(b) - set(_BACKEND_KEYS))
        if unknown:
            raise ValueError(f"{key}: unknown key {unknown[0]!r}")
        for k in _BACKEND_KEYS:
            if not isinstance(b.get(k), str) or not b[k]:
                raise ValueError(f"{key}.{k}: expected a non-empty string")
        rid, name = b["id"], b["engine_profile"]
        if rid not in regions:
            raise ValueError(f"{key}.id: unknown region {rid!r} (known: {', '.join(regions)})")
        if rid in profiles:
            raise ValueError(f"{key}.id: {rid!r} listed twice")
        profile = _resolve(name, base)
        try:
            load_profile(profile)
        except ValueError as e:
            raise ValueError(f"{key}.engine_profile: {e}") from e
        profiles[rid] = profile
    return Fleet(path, profiles)


def _resolve(name: str, base: Path) -> str:
    """A YAML path relative to the fleet file's folder; a built-in name as it is."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and not p.is_absolute():
        return str(base / p)
    return name
