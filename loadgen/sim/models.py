"""What each simulated engine serves, from the fleet file (emulator/stack/fleet.py `model`,
`lora_modules`), as its /v1/models would list it; and how its cache keeps models apart.

A region the file does not name a model for serves DEFAULT_MODEL (the vLLM twin's default
served name) with no adapters. An adapter runs on its region's engine (its GPU, batch and
KV pool) with its own cache namespace, as vLLM hashes the adapter's name into its blocks;
two base models are two engines anyway. With models in the fleet file the simulator keys
every engine block by the model the request names (`cache_salt`), so a base model's
cached prompt is no hit for an adapter on the same engine, nor the other way round.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from emulator.engine.lora import DEFAULT_MAX_LORAS, fleet_module
from emulator.stack.fleet import Fleet
from ext_proc.feeds.served_models import ServedModels

# `gorgo engine`'s served name for vLLM's twin without --served-model-name (emulator/cli.py).
DEFAULT_MODEL = "tiny"


def served_models(fleet: Fleet, region: str) -> ServedModels:
    """What region's engine lists on /v1/models: its model, and its adapters (each with
    the model as its parent)."""
    base = fleet.models.get(region, DEFAULT_MODEL)
    adapters = {fleet_module(e).name: base for e in fleet.loras.get(region, ())}
    return ServedModels(frozenset({base}), adapters)


def names_models(fleet: Fleet) -> bool:
    """Whether the fleet file names any model or adapter (else every engine serves the
    default and caches as before)."""
    return bool(fleet.models or fleet.loras)


def max_loras(fleet: Fleet, region: str) -> int | None:
    """vLLM's default cap on adapters among the running requests, where adapters load."""
    return DEFAULT_MAX_LORAS["vllm"] if fleet.loras.get(region) else None


def default_model(served: Sequence[ServedModels]) -> str:
    """The model a request naming none runs: the fleet's one base model (a fleet serving
    several refuses such a request 400, so it never reaches an engine)."""
    bases = sorted({b for s in served for b in s.base})
    return bases[0] if len(bases) == 1 else DEFAULT_MODEL


def cache_salt(model: str) -> int:
    """The salt of a model's engine blocks (an int: tuples of ints hash alike in every
    process)."""
    return zlib.crc32(f"model:{model}".encode())
