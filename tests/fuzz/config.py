"""The config loader (ext_proc/config/load.py read_config): any text as the YAML file, or
(first byte's high bit) a YAML mapping built of the schema's own keys.

Invariant: a file loads into a Config with no NaN anywhere, or is refused with
ConfigError naming the file and the key; nothing else is raised, and no input takes
long (a YAML alias bomb must not expand into a hang)."""

from __future__ import annotations

import dataclasses
import math
import tempfile
import typing
from pathlib import Path
from typing import Any

import atheris

with atheris.instrument_imports(include=["ext_proc"]):
    import yaml

    from ext_proc.config.load import read_config
    from ext_proc.config.schema import Config
    from ext_proc.vocab.params import ConfigError

from tests.fuzz import jsonish
from tests.fuzz.runner import fuzz

NAME = "config"
FILE = Path(tempfile.mkdtemp(prefix="gorgo-fuzz-config-")) / "gorgo.yaml"


def _schema_keys() -> tuple[str, ...]:
    """Every key the schema knows, at any depth."""
    keys: set[str] = set()
    seen: set[type] = set()
    todo: list[type] = [Config]
    while todo:
        cls = todo.pop()
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            keys.add(f.name)
            t = hints[f.name]
            for a in (*typing.get_args(t), t):
                if dataclasses.is_dataclass(a) and isinstance(a, type) and a not in seen:
                    seen.add(a)
                    todo.append(a)
    return tuple(sorted(keys))


KEYS = _schema_keys()


def _no_nan(value: Any, where: str) -> None:
    if isinstance(value, float):
        assert not math.isnan(value), f"{where} is NaN"
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            _no_nan(getattr(value, f.name), f"{where}.{f.name}")
    elif isinstance(value, tuple | list):
        for i, v in enumerate(value):
            _no_nan(v, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            _no_nan(v, f"{where}.{k}")


def one_input(data: bytes) -> None:
    if data[:1] and data[0] & 0x80:
        fdp = atheris.FuzzedDataProvider(data[1:])
        FILE.write_text(yaml.safe_dump(jsonish.obj(fdp, KEYS)), encoding="utf-8")
    else:
        FILE.write_bytes(data[1:])
    try:
        cfg, _text = read_config(FILE)
    except ConfigError as e:
        assert str(e).startswith(f"{FILE}: "), e
        return
    _no_nan(cfg, "config")


def main() -> None:
    fuzz(NAME, one_input)


if __name__ == "__main__":
    main()
