"""`gorgo config-schema`'s JSON Schema, generated from the loader's dataclasses, agrees with
the loader: every example config of the repository (config/, the README's, the docs') is
valid against it, and bad configs are refused by both, each at its key."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from ext_proc.cli import main
from ext_proc.config.dump import config_as_dict
from ext_proc.config.json_schema import config_schema
from ext_proc.config.load import config_from_dict, load_config
from ext_proc.config.schema import Config, TunerMode
from ext_proc.vocab.params import ConfigError

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = config_schema()
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
CONFIG_FILES = sorted([*ROOT.glob("config/*.yaml"), *ROOT.glob("config/*/*.yaml")])
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
YAML_BLOCK = re.compile(r"^```ya?ml\n(.*?)^```", re.M | re.S)
# What a fragment of a config in the docs is completed with when it shows no backends.
A_BACKEND = {"id": "a", "address": "127.0.0.1:8000"}


def errors(raw: Any) -> list[str]:
    """The schema's complaints, each as `path: message`."""
    return [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in sorted(VALIDATOR.iter_errors(raw), key=lambda e: list(e.absolute_path))
    ]


def test_the_schema_is_a_valid_draft_2020_12_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_it_carries_the_codes_types_ranges_defaults_enums_and_descriptions() -> None:
    defs = SCHEMA["$defs"]
    assert "required" not in SCHEMA and SCHEMA["additionalProperties"] is False
    assert SCHEMA["anyOf"][1] == {"required": ["discovery"]}  # backends, or discovery
    assert defs["Backend"]["required"] == ["id", "address"]
    probes = defs["Probes"]["properties"]
    assert probes["interval_s"] == {
        "type": "number",
        "exclusiveMinimum": 0,
        "default": 2.0,
        "description": probes["interval_s"]["description"],
    }
    assert probes["interval_s"]["description"].startswith("RTT probe period per backend")
    assert probes["ewma_alpha"]["maximum"] == 1 and probes["suspect_after"]["type"] == "integer"
    mode = defs["TunerConfig"]["properties"]["mode"]
    assert mode["enum"] == [m.value for m in TunerMode] and mode["default"] == "off"
    assert "paired: Parent and child on interleaved traffic" in mode["description"]
    assert defs["Routing"]["description"].startswith("The `routing:` section")
    assert "gorgo" in SCHEMA["properties"]["policy"]["enum"]
    # every section refuses unknown keys, as the loader does
    assert all(d["additionalProperties"] is False for d in defs.values())


def test_every_key_of_a_full_config_is_in_the_schema() -> None:
    """A config with every key written out (the loader's own dump) is valid: no field of
    the dataclasses is missing from the schema, and no default is out of its range."""
    cfg = config_from_dict({"backends": [A_BACKEND], "policies": {"gorgo": {}}})
    full = json.loads(json.dumps(config_as_dict(cfg)))
    assert set(full) == set(Config.__dataclass_fields__)
    assert errors(full) == []


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_repositorys_configs_are_valid(path: Path) -> None:
    load_config(path)  # the loader takes it
    assert errors(yaml.safe_load(path.read_text())) == []


def yaml_blocks() -> list[tuple[str, Any]]:
    return [
        (f"{doc.relative_to(ROOT)}:{doc.read_text()[: m.start()].count(chr(10)) + 1}", raw)
        for doc in DOCS
        for m in YAML_BLOCK.finditer(doc.read_text(encoding="utf-8"))
        if (raw := yaml.safe_load(m.group(1))) is not None
    ]


def kind_of(raw: Any) -> str:
    """What a YAML block of the docs is: an engine profile, a fleet file (its backends have
    no address: `gorgo up --fleet`, docs/engines.md), a `backends:` item, or a config."""
    if isinstance(raw, list):
        return "backend items"
    if "prefill_base_ms" in raw:
        return "engine profile"
    if raw.get("backends") and not any("address" in b for b in raw["backends"]):
        return "fleet file"
    return "config"


BLOCKS = yaml_blocks()


def test_the_docs_examples_are_found_and_told_apart() -> None:
    kinds = [kind_of(raw) for _, raw in BLOCKS]
    assert kinds.count("config") >= 5 and kinds.count("backend items") >= 1
    # only the formats that are not the router's config are left out (3 today)
    assert kinds.count("engine profile") + kinds.count("fleet file") <= 3
    assert kind_of(BLOCKS[0][1]) == "config" and BLOCKS[0][0].startswith("README.md")


@pytest.mark.parametrize(
    ("where", "raw"),
    [(w, r) for w, r in BLOCKS if kind_of(r) in ("config", "backend items")],
    ids=[w for w, r in BLOCKS if kind_of(r) in ("config", "backend items")],
)
def test_the_docs_config_examples_are_valid(where: str, raw: Any) -> None:
    """A fragment (a section, a backends item) is checked as part of a whole config."""
    if isinstance(raw, list):
        raw = {"backends": raw}
    whole = {"backends": [A_BACKEND], **raw}
    assert errors(whole) == [], where


OK = {"backends": [A_BACKEND]}


def with_(path: str, value: Any) -> dict[str, Any]:
    """OK with the value at a dotted path (`backends.0.engine`) set."""
    raw = copy.deepcopy(OK)
    *parents, last = path.split(".")
    node: Any = raw
    for p in parents:
        node = node[int(p)] if p.isdigit() else node.setdefault(p, {})
    if last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    return raw


# Bad configs both refuse: (config, the key the loader's error names, the path of the
# schema's complaint; ":" = the top level).
BAD = [
    (with_("routing.block_tokens", 0), "routing.block_tokens", "routing.block_tokens"),
    (with_("routing.block_tokens", 2.5), "routing.block_tokens", "routing.block_tokens"),
    (with_("routing.block_tokns", 16), "routing.block_tokns", "routing"),
    (with_("probes.ewma_alpha", 1.5), "probes.ewma_alpha", "probes.ewma_alpha"),
    (with_("probes.interval_s", "2s"), "probes.interval_s", "probes.interval_s"),
    (with_("routing.learn_latency", "yes"), "routing.learn_latency", "routing.learn_latency"),
    (with_("tuner.mode", "on"), "tuner.mode", "tuner.mode"),
    (with_("policy", "fastest"), "policy", "policy"),
    (with_("policies.fastest", {}), "policies.fastest", "policies"),
    (
        with_("policies.gorgo", {"weights": {"rtt": 0}}),
        "policies.gorgo.weights.rtt",
        "policies.gorgo",  # anyOf: the parameters, or nothing
    ),
    (with_("backends.0.engine", "trt"), "backends[0].engine", "backends.0.engine"),
    (
        with_("backends.0.kv_events", {"dp_ranks": 0}),
        "backends[0].kv_events.dp_ranks",
        "backends.0.kv_events.dp_ranks",
    ),
    (with_("backends.0.models", "tiny"), "backends[0].models", "backends.0.models"),
    (with_("backends.0", {"id": "a"}), "backends[0].address", "backends.0"),
    (with_("weights", {"rtt": 1}), "weights", ":"),  # moved: the loader names where to
    ({"policy": "gorgo"}, "backends", ":"),
    (with_("models", [{"name": "m"}]), "models[0].served", "models.0"),
    (
        with_("flow_control.objectives", [{"name": "x", "priority": "high"}]),
        "flow_control.objectives[0].priority",
        "flow_control.objectives.0.priority",
    ),
    (with_("telemetry.sample_ratio", -0.1), "telemetry.sample_ratio", "telemetry.sample_ratio"),
    (with_("envoy.mode", "ext_proc"), "envoy.mode", "envoy.mode"),
]


@pytest.mark.parametrize(
    ("raw", "key", "path"), BAD, ids=[b[1] or str(i) for i, b in enumerate(BAD)]
)
def test_a_bad_config_is_refused_by_the_loader_and_the_schema(
    raw: dict[str, Any], key: str, path: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        config_from_dict(raw)
    assert str(refused.value).startswith(key)
    found = errors(raw)
    assert found, f"the schema takes what the loader refuses: {refused.value}"
    assert any(e.startswith(path) for e in found), found


def test_config_schema_prints_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config-schema"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(SCHEMA))
