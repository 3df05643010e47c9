"""The config as plain values (what `load` reads back), and what a reload changed."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from ext_proc.config.schema import Config
from ext_proc.vocab.backend import Backend


def plain_value(value: Any) -> Any:
    """A config value as YAML and JSON write it: enums by value, tuples as lists."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [plain_value(v) for v in value]
    if isinstance(value, Mapping):
        return {k: plain_value(v) for k, v in value.items()}
    return value


def config_as_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain YAML-able values: `config_from_dict` reads it back."""
    plain: dict[str, Any] = plain_value(dataclasses.asdict(cfg))
    return plain


def backend_as_dict(b: Backend) -> dict[str, Any]:
    plain: dict[str, Any] = plain_value(dataclasses.asdict(b))
    return plain


def changed_keys(old: Config, new: Config, skip: tuple[str, ...] = ("backends",)) -> list[str]:
    """The dotted keys whose values differ between two configs (sections compared field
    by field, `policies.<name>` per policy), except `skip`."""
    out: list[str] = []

    def walk(a: Any, b: Any, key: str) -> None:
        if key in skip or a == b:
            return
        if dataclasses.is_dataclass(a) and type(a) is type(b) and not isinstance(a, Backend):
            for f in dataclasses.fields(a):
                walk(getattr(a, f.name), getattr(b, f.name), f"{key}.{f.name}" if key else f.name)
        elif isinstance(a, Mapping) and isinstance(b, Mapping) and key == "policies":
            for name in sorted(set(a) | set(b)):
                walk(a.get(name), b.get(name), f"{key}.{name}")
        else:
            out.append(key)

    walk(old, new, "")
    return out
