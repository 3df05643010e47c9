"""The `gorgo` command line: a bare `gorgo` (and `gorgo bench`) prints its help, `--version`
the package's version, every command has a description, every flag's help shows its default,
and the top-level help lists router commands (those ext_proc/cli.py's ROUTER_COMMANDS
registers) apart from harness commands (those the `gorgo.commands` entry points add)."""

from __future__ import annotations

import argparse
import re
import tomllib
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from ext_proc import cli
from ext_proc.cli import Commands, build_parser, main, shows_default, typed

ROOT = Path(__file__).resolve().parents[2]
# Some of what the harness's entry points add (emulator/cli.py, loadgen/cli.py).
HARNESS = {"engine", "wan", "up", "bench", "demo", "replay", "simulate", "soak"}


def parsers(p: argparse.ArgumentParser, name: str = "gorgo") -> Iterator[tuple[str, Any]]:
    """`gorgo`, `gorgo serve`, `gorgo bench load`, ... and each one's parser."""
    yield name, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, sp in action.choices.items():
                yield from parsers(sp, f"{name} {sub}")


def section(help_text: str, title: str) -> list[str]:
    """The command names a section of the top-level help lists (its rows' first words)."""
    body = help_text.split(f"\n{title}:\n", 1)[1].split("\n\n", 1)[0]
    return [line.split()[0] for line in body.splitlines() if re.match(r"  \S", line)]


def router_command_names() -> list[str]:
    """The commands ROUTER_COMMANDS registers, each on a parser of its own."""
    p = argparse.ArgumentParser()
    commands = Commands(p.add_subparsers(), [])
    for add in cli.ROUTER_COMMANDS:
        add(commands)
    return list(commands.sub.choices)


def test_a_bare_gorgo_prints_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out == build_parser().format_help()
    assert out.startswith("usage: gorgo") and "router commands:" in out


def test_a_bare_gorgo_bench_prints_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gorgo bench") and "engine-model" in out and "results" in out


def test_version_prints_the_installed_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert version(cli.DISTRIBUTION) == project["version"]
    assert capsys.readouterr().out == f"gorgo {project['version']}\n"


def test_router_and_harness_commands_are_grouped_by_where_they_come_from() -> None:
    p = build_parser()
    text = p.format_help()
    router = section(text, "router commands")
    harness = section(text, f"harness commands ({cli.HARNESS_INSTALL})")
    assert router == router_command_names()
    assert {"serve", "envoy-config"} <= set(router)
    assert set(harness) >= HARNESS and not set(router) & set(harness)
    assert sorted(router + harness) == sorted(p._subparsers._group_actions[0].choices)
    assert "COMMAND" in text.split("router commands:")[0]  # not each command a second time
    assert "serve" not in text.split("router commands:")[0]
    assert "docs/configuration.md#the-gorgo-command" in text and "README.md" in text


def test_a_router_command_registered_in_the_list_is_listed_as_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def add_probe(commands: Commands) -> None:
        commands.sub.add_parser("probe-cmd", help="a command of the test", description="x")

    monkeypatch.setattr(cli, "ROUTER_COMMANDS", (*cli.ROUTER_COMMANDS, add_probe))
    text = build_parser().format_help()
    assert section(text, "router commands")[-1] == "probe-cmd"
    assert "probe-cmd" not in section(text, f"harness commands ({cli.HARNESS_INSTALL})")


def test_without_the_harness_its_group_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "entry_points", lambda group: [])
    text = build_parser().format_help()
    assert section(text, "router commands") == router_command_names()
    after = text.split(f"harness commands ({cli.HARNESS_INSTALL}):\n", 1)[1]
    assert after.lstrip().startswith("not installed here")
    assert not HARNESS & set(re.findall(r"^  (\S+)", after, re.M))


def test_every_command_has_a_description() -> None:
    missing = [name for name, p in parsers(build_parser()) if not (p.description or "").strip()]
    assert not missing, f"commands without a description: {missing}"
    # and a help row in its parent's list
    rows = [
        name
        for _, p in parsers(build_parser())
        for a in p._actions
        if isinstance(a, argparse._SubParsersAction)
        for name, sp in a.choices.items()
        if not any(r.dest == name and r.help for r in a._choices_actions)
    ]
    assert set(rows) <= set(router_command_names()) | HARNESS  # the top level's are grouped


def _flag_help(p: Any, action: argparse.Action) -> str:
    """One flag's lines of its command's help, whitespace removed (wrapping breaks lines)."""
    formatter = p.formatter_class(prog=p.prog)
    formatter.add_argument(action)
    return re.sub(r"\s+", "", formatter.format_help())


def test_every_flag_shows_its_default() -> None:
    shown = 0
    for name, p in parsers(build_parser()):
        for action in p._actions:
            text = _flag_help(p, action)
            if shows_default(action):
                expected = re.sub(r"\s+", "", f"(default: {typed(action.default)})")
                assert text.count(expected) == 1, (name, action.option_strings, text)
                shown += 1
            else:  # nothing added: no "(default: None)", "(default: False)", "(default: )"
                assert not re.search(r"\(default:(None|False|\[\]|\))", text), (name, text)
    assert shown > 50  # every command's flags, the harness's too


def test_what_shows_as_a_default() -> None:
    def flag(**kw: Any) -> argparse.Action:
        return argparse.ArgumentParser().add_argument("--x", **kw)

    assert [shows_default(flag(default=d)) for d in (0, 0.0, "a", [0], None, "", [])] == [
        True,
        True,
        True,
        True,
        False,
        False,
        False,
    ]
    assert not shows_default(flag(action="store_true"))
    assert shows_default(flag(action="store_false"))
    assert typed([0, 1, 2]) == "0 1 2" and typed(6.0) == "6.0"
    p = cli.Parser(prog="t")
    p.add_argument("--rate", type=float, default=0.5, help="share at 50 %%")
    p.add_argument("--seeds", type=int, nargs="+", default=[3, 4])
    text = " ".join(p.format_help().split())
    assert (
        "share at 50 % (default: 0.5)" in text
        and "--seeds SEEDS [SEEDS ...] (default: 3 4)" in text
    )


def test_no_help_prints_a_default_taken_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GORGO_ADMIN_TOKEN", "secret-token-from-env")
    for name, p in parsers(build_parser()):
        assert "secret-token-from-env" not in p.format_help(), name
