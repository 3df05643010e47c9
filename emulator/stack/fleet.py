"""Fleet files: which engine profile each region's engine really runs (the engines' truth,
for `gorgo simulate --fleet` and `gorgo up --fleet`), apart from what the router is told,
and which model and LoRA adapters it serves (`gorgo up --fleet`).

    backends:
      - id: us-ashburn
        engine_profile: l40s-qwen3.5-35b-a3b-fp8   # a built-in profile
      - id: eu-frankfurt
        engine_profile: fast.yaml                  # a file, relative to this one
        model: alpha                               # the served name (--served-model-name)
        lora_modules: [sql, chat=/lora/chat-v2]    # adapters loaded at start

A region the file does not list runs the default profile and serves the default name
with no adapters; `lora_modules` entries are NAME (its path a synthetic /lora/NAME) or
NAME=PATH (emulator/engine/lora.py fleet_module).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from emulator.engine.lora import fleet_module
from ext_proc.estimate.profile import load_profile

_BACKEND_KEYS = ("id", "engine_profile", "model", "lora_modules")


@dataclass(frozen=True)
class Fleet:
    # Where it was read from ("" for none), for result files and messages.
    path: str = ""
    # Region id -> engine profile (a built-in name, or a YAML path resolved beside the file).
    profiles: Mapping[str, str] = field(default_factory=dict)
    # Region id -> the model name its engine serves (absent: the engine's default).
    models: Mapping[str, str] = field(default_factory=dict)
    # Region id -> the LoRA adapters its engine loads at start (NAME or NAME=PATH).
    loras: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

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
    models: dict[str, str] = {}
    loras: dict[str, tuple[str, ...]] = {}
    seen: set[str] = set()
    for i, b in enumerate(backends):
        key = f"{where}: backends[{i}]"
        if not isinstance(b, dict):
            raise ValueError(f"{key}: expected a mapping with id and engine_profile")
        unknown = sorted(set(b) - set(_BACKEND_KEYS))
        if unknown:
            raise ValueError(f"{key}: unknown key {unknown[0]!r}")
        rid = b.get("id")
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"{key}.id: expected a non-empty string")
        if rid not in regions:
            raise ValueError(f"{key}.id: unknown region {rid!r} (known: {', '.join(regions)})")
        if rid in seen:
            raise ValueError(f"{key}.id: {rid!r} listed twice")
        seen.add(rid)
        if not {"engine_profile", "model", "lora_modules"} & set(b):
            raise ValueError(
                f"{key}.engine_profile: expected a non-empty string (or model, lora_modules)"
            )
        if "engine_profile" in b:
            name = b["engine_profile"]
            if not isinstance(name, str) or not name:
                raise ValueError(f"{key}.engine_profile: expected a non-empty string")
            profile = _resolve(name, base)
            try:
                load_profile(profile)
            except ValueError as e:
                raise ValueError(f"{key}.engine_profile: {e}") from e
            profiles[rid] = profile
        if "model" in b:
            model = b["model"]
            if not isinstance(model, str) or not model.strip():
                raise ValueError(f"{key}.model: expected a non-empty model name")
            models[rid] = model
        if "lora_modules" in b:
            loras[rid] = _loras(b["lora_modules"], models.get(rid), f"{key}.lora_modules")
    return Fleet(path, profiles, models, loras)


def _loras(raw: Any, model: str | None, key: str) -> tuple[str, ...]:
    """A backend's adapters: a list of NAME or NAME=PATH, names unique and not the model's."""
    if not isinstance(raw, list):
        raise ValueError(f"{key}: expected a list of adapter names (NAME or NAME=PATH)")
    names: set[str] = set()
    for j, entry in enumerate(raw):
        where = f"{key}[{j}]"
        if not isinstance(entry, str) or not entry.strip():
            raise ValueError(f"{where}: expected an adapter name (NAME or NAME=PATH)")
        m = fleet_module(entry)
        if not m.name or not m.path or any(c.isspace() for c in m.name):
            raise ValueError(f"{where}: {entry!r}: expected NAME or NAME=PATH")
        if m.name in names:
            raise ValueError(f"{where}: adapter {m.name!r} listed twice")
        if m.name == model:
            raise ValueError(f"{where}: adapter {m.name!r} has the model's own name")
        names.add(m.name)
    return tuple(raw)


def _resolve(name: str, base: Path) -> str:
    """A YAML path relative to the fleet file's folder; a built-in name as it is."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and not p.is_absolute():
        return str(base / p)
    return name
