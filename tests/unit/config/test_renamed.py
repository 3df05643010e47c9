"""A config section renamed keeps loading under its old name: `fleet:` (the routers' bus,
before the word went to the backends alone) loads as `bus:`, with a warning naming the new
key, in the loader, in `gorgo check` and in the JSON schema; both names at once is an
error naming both."""

from __future__ import annotations

import logging
from pathlib import Path

import jsonschema
import pytest
import yaml

from ext_proc.cli import main
from ext_proc.config.json_schema import config_schema
from ext_proc.config.load import config_from_dict, load_config
from ext_proc.vocab.params import ConfigError

BACKEND = {"id": "a", "address": "127.0.0.1:1"}
BUS = {"nats_url": "nats://127.0.0.1:4222", "router_id": "r1", "peer_ttl_s": 30}


def test_the_old_name_loads_as_the_new_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gorgo.config"):
        old = config_from_dict({"backends": [BACKEND], "fleet": BUS})
    assert old == config_from_dict({"backends": [BACKEND], "bus": BUS})
    assert old.bus.router_id == "r1" and old.bus.peer_ttl_s == 30
    (said,) = [r.getMessage() for r in caplog.records]
    assert said == "config: fleet is deprecated, renamed bus: write bus: instead"


def test_the_new_name_loads_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gorgo.config"):
        config_from_dict({"backends": [BACKEND], "bus": BUS})
    assert caplog.records == []


def test_both_names_at_once_is_an_error_naming_both() -> None:
    with pytest.raises(ConfigError, match=r"^bus: given twice, as bus and as fleet"):
        config_from_dict({"backends": [BACKEND], "bus": BUS, "fleet": BUS})


def test_an_error_under_the_old_name_names_the_key_as_written() -> None:
    with pytest.raises(ConfigError, match=r"^fleet\.peer_ttl_s: "):
        config_from_dict({"backends": [BACKEND], "fleet": {"peer_ttl_s": 0}})
    with pytest.raises(ConfigError, match=r"^fleet\.nats_ur: unknown key"):
        config_from_dict({"backends": [BACKEND], "fleet": {"nats_ur": "x"}})


def test_gorgo_check_warns_of_the_old_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gorgo.yaml"
    path.write_text(yaml.safe_dump({"backends": [BACKEND], "fleet": BUS}))
    assert load_config(path).bus.nats_url == BUS["nats_url"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gorgo.config"):
        main(["check", "--config", str(path), "--timeout-s", "0.2"])  # nothing listens there
    assert "fleet is deprecated, renamed bus" in caplog.text
    assert "gorgo check: " not in capsys.readouterr().err  # it loaded


def test_the_schema_takes_the_old_name_as_deprecated_never_both() -> None:
    schema = config_schema()
    validator = jsonschema.Draft202012Validator(schema)
    old = schema["properties"]["fleet"]
    assert old["deprecated"] is True and old["$ref"] == schema["properties"]["bus"]["$ref"]
    assert "Renamed `bus`" in old["description"]
    assert not list(validator.iter_errors({"backends": [BACKEND], "fleet": BUS}))
    assert not list(validator.iter_errors({"backends": [BACKEND], "bus": BUS}))
    assert list(validator.iter_errors({"backends": [BACKEND], "bus": BUS, "fleet": BUS}))
