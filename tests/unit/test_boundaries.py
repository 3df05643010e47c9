"""The product stands alone: `ext_proc` imports nothing of its harness (emulator/,
loadgen/) or of what only the harness needs (matplotlib). The router run in a fresh
interpreter where the harness cannot load: tests/component/test_boundaries.py."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ext_proc_never_imports_the_harness() -> None:
    pattern = re.compile(r"^\s*(from|import) (emulator|loadgen)\b", re.M)
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "ext_proc").rglob("*.py")
        if pattern.search(p.read_text(encoding="utf-8"))
    ]
    assert offenders == []


def test_the_harness_adds_its_subcommands() -> None:
    from ext_proc.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert {"serve", "envoy-config", "engine", "wan", "up", "demo", "replay", "simulate"} <= set(
        commands
    )
    bench = commands["bench"]._subparsers._group_actions[0].choices
    assert {"overhead", "results", "parity", "live", "load", "decide", "engine"} <= set(bench)
    assert "engine-model" in bench  # contributed by the emulator to the same group
