"""The names the README and docs/ give exist in the code: every config key (and, in
docs/configuration.md, every key of the schema is there, with the default the code has
where the table gives a literal one), every `gorgo ...` flag, every endpoint and every
metric; and no `--help` text names a flag that is gone. Docs that drift fail here."""

from __future__ import annotations

import argparse
import dataclasses
import random
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest.mock import AsyncMock, MagicMock

import pytest

from emulator.engine.config import EngineConfig
from emulator.engine.disagg.sides import bootstrap_app, side_channel_app
from emulator.engine.server import make_app
from ext_proc.cli import build_parser
from ext_proc.config.load import MOVED, config_from_dict
from ext_proc.config.schema import Config
from ext_proc.core.build import build_router
from ext_proc.director.recipe import Director
from ext_proc.policy.catalog import POLICIES
from ext_proc.service.admin.api import make_admin_app
from ext_proc.service.admin.operator_page import add_page_routes
from ext_proc.service.telemetry.gauges import BusGauges, FlowGauges
from ext_proc.service.telemetry.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DOCS = {
    p.relative_to(ROOT).as_posix(): p.read_text()
    for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
}
CONFIG_DOC = "docs/configuration.md"
TICKED = re.compile(r"`([^`\n]+)`")
TOP = {f.name for f in dataclasses.fields(Config)}


# -- config keys -----------------------------------------------------------------------------


def _fields_of(cls: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _element(typ: Any) -> Any:
    """tuple[X, ...] -> X; anything else unchanged."""
    args = typing.get_args(typ)
    return args[0] if typing.get_origin(typ) is tuple and args else typ


def resolve(key: str) -> Any:
    """The type a dotted config key names (`backends[].kv_events.endpoint`,
    `policies.gorgo.weights.rtt`, `policies.<name>`); KeyError when there is none."""
    parts = key.split(".")
    typ: Any = Config
    i = 0
    while i < len(parts):
        name = parts[i].removesuffix("[]")
        if typ is Config and name == "policies":
            if i + 1 == len(parts) or parts[i + 1] == "<name>":
                return dict
            typ, i = POLICIES[parts[i + 1]].params, i + 2
            continue
        if not dataclasses.is_dataclass(typ):
            raise KeyError(key)
        typ = _element(_fields_of(typ)[name])
        i += 1
    return typ


def schema_keys() -> Iterator[str]:
    """Every leaf key of the schema and of each policy's parameters."""

    def walk(cls: Any, prefix: str) -> Iterator[str]:
        for name, typ in _fields_of(cls).items():
            if prefix == "" and name == "policies":
                for pname, info in POLICIES.items():
                    yield from walk(info.params, f"policies.{pname}.")
                continue
            inner = _element(typ)
            if dataclasses.is_dataclass(inner):
                mark = "[]" if inner is not typ else ""
                yield from walk(inner, f"{prefix}{name}{mark}.")
            else:
                yield f"{prefix}{name}"

    return walk(Config, "")


def _row_keys(cell: str) -> list[str]:
    """A table row's key cell -> full keys: `probes.interval_s`, `timeout_s` and
    `backends[].kv_events.topic`, `.replay_endpoint` name siblings of the first key."""
    keys: list[str] = []
    for tok in TICKED.findall(cell):
        tok = tok.lstrip(".")
        if keys and tok.split(".")[0].removesuffix("[]") not in TOP:
            tok = f"{keys[0].rpartition('.')[0]}.{tok}".lstrip(".")
        keys.append(tok)
    return keys


def config_rows() -> list[tuple[list[str], str]]:
    """docs/configuration.md's key tables: (keys, default cell) per row."""
    rows = []
    for line in DOCS[CONFIG_DOC].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 3 and not cells[0].startswith("`gorgo"):
            rows.append((_row_keys(cells[0]), cells[1]))
    return rows


# Prose names that look like config keys but are Envoy's, files, or modules.
NOT_KEYS = re.compile(
    r"^envoy\.(filters|extensions|lb|access_loggers|transport_sockets)|\.(ya?ml|json|md|py|jinja)$"
)
KEY_LIKE = re.compile(r"^[a-z_]+(\[\])?(\.[a-z0-9_<>]+(\[\])?)+$")


def prose_keys() -> Iterator[tuple[str, str]]:
    """Backticked config keys in prose; not /state's fields (`/state` `tokenizer.failures`,
    `backends.<id>.tokens`), nor keys the loader names as moved or removed (MOVED)."""
    for doc, text in DOCS.items():
        for m in TICKED.finditer(text):
            tok = m.group(1).split(":")[0].split("=")[0].strip()
            first = tok.split(".")[0].removesuffix("[]")
            state = "/state` " in text[max(0, m.start() - 9) : m.start()] or "<id>" in tok
            if first in TOP and KEY_LIKE.match(tok) and not NOT_KEYS.search(tok):  # noqa: SIM102
                if not state and tok not in MOVED:
                    yield doc, tok


def test_every_config_key_the_docs_name_exists() -> None:
    missing = []
    for keys, _ in config_rows():
        missing += [(CONFIG_DOC, k) for k in keys if not _exists(k)]
    missing += [(doc, k) for doc, k in prose_keys() if not _exists(k)]
    assert not missing, missing


def _exists(key: str) -> bool:
    try:
        resolve(key)
    except KeyError:
        return False
    return True


def test_every_schema_key_is_in_the_configuration_doc() -> None:
    documented = {k for keys, _ in config_rows() for k in keys}
    # A key is documented by its own row or by a row of a section it is in (`models[]`).
    absent = [
        k
        for k in schema_keys()
        if not any(".".join(k.split(".")[:n]) in documented for n in range(1, k.count(".") + 2))
    ]
    assert not absent, f"{CONFIG_DOC} documents none of: {absent}"


LITERAL = re.compile(r"^`(-?[0-9.]+|true|false|\"\"|[a-z_]+)`")


def _default_of(key: str) -> Any:
    parent, _, name = key.rpartition(".")
    cls = resolve(parent) if parent else Config
    f = {f.name: f for f in dataclasses.fields(cls)}[name.removesuffix("[]")]
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def test_the_defaults_in_the_configuration_doc_are_the_codes() -> None:
    wrong = []
    for keys, cell in config_rows():
        literals = [t for t in re.split(r",\s*", cell) if LITERAL.match(t)]
        if len(literals) != len(keys) or "required" in cell:
            continue
        for key, lit in zip(keys, literals, strict=True):
            text = LITERAL.match(lit).group(1)  # type: ignore[union-attr]
            value = _default_of(key)
            if isinstance(value, bool):
                ok = text == str(value).lower()
            elif isinstance(value, int | float):
                ok = _number(text) == value
            else:
                ok = text == ('""' if value in ("", ()) else str(value))
            if not ok:
                wrong.append((key, lit, value))
    assert not wrong, wrong


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


# -- CLI flags -------------------------------------------------------------------------------


def parsers() -> dict[str, argparse.ArgumentParser]:
    """`gorgo`, `gorgo serve`, `gorgo bench load`, ... -> its parser."""
    out: dict[str, argparse.ArgumentParser] = {}

    def walk(p: argparse.ArgumentParser, name: str) -> None:
        out[name] = p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, sp in action.choices.items():
                    walk(sp, f"{name} {sub}")

    walk(build_parser(), "gorgo")
    return out


PARSERS = parsers()
ALL_FLAGS = {o for p in PARSERS.values() for a in p._actions for o in a.option_strings}
COMMAND = re.compile(
    r"\bgorgo ((?:[a-z][a-z0-9-]*(?:\|[a-z][a-z0-9-]*)*)(?: [a-z][a-z0-9-]*)?)(?![\w])"
)
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _commands_of(text: str) -> list[str]:
    """The parsers a `gorgo ...` mention names: `gorgo replay|simulate X` is both."""
    m = COMMAND.search(text)
    if m is None:
        return []
    head, _, second = m.group(1).partition(" ")
    names = []
    for first in head.split("|"):
        name = f"gorgo {first} {second}".strip()
        names.append(name if name in PARSERS else f"gorgo {first}")
    return names


def command_mentions() -> Iterator[tuple[str, str, str]]:
    """(doc, command text, flags text): each backticked `gorgo ...` span and each code-block
    line that runs gorgo; a row of the command table carries its whole row's flags."""
    for doc, text in DOCS.items():
        fenced = False
        for line in text.splitlines():
            if line.startswith("```"):
                fenced = not fenced
                continue
            if fenced:
                run = line.split(" #")[0].strip()
                if run.startswith(("gorgo ", ".venv/bin/gorgo ")):
                    yield doc, run, run
                continue
            cells = line.strip().strip("|").split("|")
            if doc == CONFIG_DOC and line.startswith("| `gorgo "):
                # The row's flags are its command's, but for other commands' own spans.
                rest = re.sub(r"`gorgo [^`]*`", "", "|".join(cells[1:]))
                yield doc, cells[0], cells[0] + rest
                line = "|".join(cells[1:])
            for span in TICKED.findall(line):
                if span.startswith("gorgo "):
                    yield doc, span, span


# Flags of the real engines (vLLM, SGLang) that a command-table row quotes as theirs, and
# Envoy's, that are not gorgo's own.
FOREIGN = {"--mode", "--disable-hot-restart"}


def test_every_gorgo_flag_the_docs_name_exists() -> None:
    wrong = []
    for doc, command, flags in command_mentions():
        names = _commands_of(command)
        if not names:
            continue
        unknown = [n for n in names if n not in PARSERS]
        if unknown:
            wrong.append((doc, command, f"no command {unknown}"))
            continue
        for flag in set(FLAG.findall(flags)) - FOREIGN:
            own = {o for n in names for a in PARSERS[n]._actions for o in a.option_strings}
            if flag not in own:
                wrong.append((doc, command, flag))
    assert not wrong, wrong


def test_the_help_texts_name_no_flag_that_is_gone() -> None:
    wrong = [
        (name, flag)
        for name, p in PARSERS.items()
        for text in [p.description or "", *(a.help or "" for a in p._actions)]
        for flag in FLAG.findall(text)
        if flag not in ALL_FLAGS and flag not in FOREIGN
    ]
    assert not wrong, wrong


# -- endpoints -------------------------------------------------------------------------------


def _routes(app: Any) -> set[str]:
    return {r.canonical for r in app.router.resources()}


def known_paths() -> set[str]:
    admin = make_admin_app(MagicMock(), MagicMock(), dict)
    add_page_routes(admin, MagicMock(), "")
    paths = _routes(admin)
    for flavor in ("sglang", "vllm"):
        paths |= _routes(make_app(EngineConfig(name="x", flavor=flavor, enable_lora=True)))
    # A P/D twin's side servers: SGLang's bootstrap server, vLLM's NIXL side channel.
    paths |= _routes(bootstrap_app("127.0.0.1", 1, *[AsyncMock()] * 3))
    paths |= _routes(side_channel_app({}, AsyncMock()))
    return paths | {"/rtt"} | ENVOY | ENGINES_ONLY


# Envoy's admin endpoints the docs point at, and the real engines' that the twin lacks.
ENVOY = {"/clusters", "/config_dump", "/stats", "/ready"}
ENGINES_ONLY = {"/detokenize", "/alerts"}
METHOD_PATH = re.compile(r"\b(?:GET|POST|DELETE|PUT) (/[A-Za-z0-9_/{}.-]*)")
TICKED_PATH = re.compile(r"`(/[a-z0-9_/{}-]+)`")


def test_every_endpoint_the_docs_name_exists() -> None:
    known = known_paths()
    wrong = [
        (doc, path)
        for doc, text in DOCS.items()
        for path in {*METHOD_PATH.findall(text), *TICKED_PATH.findall(text)}
        if path != "/" and path.rstrip("/") not in known
    ]
    assert not wrong, wrong


# -- metrics ---------------------------------------------------------------------------------


def all_metrics() -> Metrics:
    """The router's metrics with every feature that adds some on (a tuner, flow control)."""
    backends = [{"id": "a", "address": "127.0.0.1:1"}]
    cfg = config_from_dict(
        {"backends": backends, "tuner": {"mode": "paired"}, "flow_control": {"enabled": True}}
    )
    router = build_router(cfg, lambda: 0.0, random.Random(0))
    metrics = Metrics(router)
    metrics.registry.register(FlowGauges(Director(router)))  # as the service registers it
    bus = {"connected": True, "sent": 0, "received": 0, "dropped": 0, "malformed": 0}
    metrics.registry.register(BusGauges(lambda: bus))  # a router with bus.nats_url
    return metrics


def metric_names() -> set[str]:
    names = set()
    for family in all_metrics().registry.collect():
        names.add(family.name)
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
        names |= {family.name + s for s in suffixes.get(family.type, ())}
    return names


# `gorgo_*` names that are not metrics: policies, Envoy clusters and routes, span names.
NOT_METRICS = {*POLICIES, "gorgo_ext_proc", "gorgo_fallback", "gorgo_observe", "gorgo_pool"}
METRIC = re.compile(r"\bgorgo_[a-z0-9_]+")


# Renamed to Prometheus' conventions (base units, counters in _total, fractions in _ratio):
# the old names are gone, listed only in docs/operations.md's "Renamed metrics" table.
RENAMED_METRICS = {
    "gorgo_rtt_ms": "gorgo_rtt_seconds",
    "gorgo_cost_term_ms": "gorgo_cost_term_seconds",
    "gorgo_kv_event_gaps": "gorgo_kv_event_gaps_total",
    "gorgo_kv_event_resets": "gorgo_kv_event_resets_total",
    "gorgo_kv_event_unknown_parents": "gorgo_kv_event_unknown_parents_total",
    "gorgo_ttft_prediction_mape": "gorgo_ttft_prediction_mape_ratio",
    "gorgo_e2e_prediction_mape": "gorgo_e2e_prediction_mape_ratio",
    "gorgo_ttft_prediction_bias_ms": "gorgo_ttft_prediction_bias_seconds",
    "gorgo_e2e_prediction_bias_ms": "gorgo_e2e_prediction_bias_seconds",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _section(doc: str, heading: str) -> str:
    return DOCS[doc].split(f"{heading}\n", 1)[1].split("\n#", 1)[0]


def _column(table: str, n: int = 0) -> list[list[str]]:
    """The ticked names in each row's n-th cell."""
    return [
        TICKED.findall(line.split("|")[n + 1])
        for line in table.splitlines()
        if line.startswith("| `")
    ]


def exported() -> dict[str, str]:
    """Every metric family in the exposition (name as scraped: counters with _total) and
    its type; prometheus_client's own `_created` series left out."""
    text = all_metrics().render().decode()
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE"))
    return {n: t for n, t in types.items() if not n.endswith("_created")}


def test_every_metric_the_docs_name_exists() -> None:
    known = metric_names() | NOT_METRICS
    renamed = _section("docs/operations.md", "### Renamed metrics")
    wrong = [
        (doc, m)
        for doc, text in DOCS.items()
        for m in set(
            METRIC.findall(text.replace(renamed, "") if doc.endswith("operations.md") else text)
        )
        if m not in known
    ]
    assert not wrong, wrong


def documented_metrics() -> set[str]:
    """The metrics docs/operations.md's table lists (as scraped: counters with _total)."""
    table = _section("docs/operations.md", "## Metrics (`/metrics`)")
    return {name for names in _column(table) for name in names}


def test_the_metrics_table_lists_every_metric_the_router_exports() -> None:
    assert documented_metrics() == set(exported())


def test_the_renamed_metrics_are_gone_and_their_new_names_exported() -> None:
    table = _section("docs/operations.md", "### Renamed metrics")
    listed = {old[0]: new[0] for old, new in zip(_column(table), _column(table, 1), strict=True)}
    assert listed == RENAMED_METRICS
    names = exported()
    text = all_metrics().render().decode()
    samples = {line.split("{")[0].split()[0] for line in text.splitlines() if line[:1] != "#"}
    for old, new in RENAMED_METRICS.items():
        assert new in names
        gone = {old, *(old + s for s in ("_total", *HISTOGRAM_SUFFIXES))} - {new}
        assert not gone & (set(names) | samples), old
    # the counters are counters, in seconds what was in ms
    assert {names[n] for n in RENAMED_METRICS.values() if n.endswith("_total")} == {"counter"}
    assert names["gorgo_cost_term_seconds"] == "histogram"


@pytest.mark.parametrize("name", sorted(NOT_METRICS - set(POLICIES)))
def test_the_non_metric_names_are_envoy_config_names(name: str) -> None:
    source = (ROOT / "ext_proc/envoy_config/clusters.py").read_text()
    assert f'"{name}"' in source


def test_every_command_is_in_the_configuration_doc() -> None:
    mentions = [cmd for doc, cmd, _ in command_mentions() if doc == CONFIG_DOC]
    named = {n for cmd in mentions for n in _commands_of(cmd)}
    absent = sorted(set(PARSERS) - named - {"gorgo", "gorgo bench"})
    assert not absent, f"{CONFIG_DOC}'s command table lacks {absent}"


def test_every_span_attribute_is_in_the_operations_doc() -> None:
    from ext_proc.service.telemetry import spans

    doc = DOCS["docs/operations.md"]
    names = [v for k, v in vars(spans).items() if k.startswith("A_") and isinstance(v, str)]

    def named(attr: str) -> bool:  # `gorgo.kv_events.age_s`, `.gaps` names both
        attr = attr.split("{")[0].rstrip(".")
        parent, _, last = attr.rpartition(".")
        return f"`{attr}" in doc or (f"`{parent}." in doc and f"`.{last}`" in doc)

    absent = [n for n in names if not named(n)]
    assert names and not absent, f"docs/operations.md's span table lacks {absent}"


# -- references a reader cannot follow -------------------------------------------------------

# Tracker issues, the design notes (DESIGN.md, kept outside the repo) and commit hashes:
# the docs say what they mean instead (the target itself, "the paper" with README's
# Citation, a date).
INTERNAL = re.compile(r"\b[Ii]ssues?\s+\d+|\bDESIGN\b")
COMMIT_LIKE = re.compile(r"\b[0-9a-f]{7,12}\b")
# 7-12 hex-digit tokens that are data the text gives, not commits.
DATA_VALUES = {
    "9835490",  # docs/cost-model.md: kv_capacity_tokens, ten times the default pool
}


def test_the_docs_name_no_issue_design_section_or_commit() -> None:
    wrong = []
    for doc, text in DOCS.items():
        found = [*INTERNAL.finditer(text), *COMMIT_LIKE.finditer(text)]
        for m in found:
            if m.group() not in DATA_VALUES:
                line = text.count("\n", 0, m.start()) + 1
                wrong.append(f"{doc}:{line}: {m.group()!r}")
    assert not wrong, wrong


def test_no_help_text_names_an_issue() -> None:
    wrong = [
        (name, m.group())
        for name, parser in PARSERS.items()
        for m in INTERNAL.finditer(parser.format_help())
    ]
    assert not wrong, wrong
