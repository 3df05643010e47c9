"""The product stands alone: `ext_proc` imports nothing of its harness (emulator/,
loadgen/) or of what only the harness needs (matplotlib)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ("emulator", "loadgen", "matplotlib")

# Runs in a fresh interpreter where importing the harness fails, as in an install without
# it: the router's modules and its two subcommands must work.
PROBE = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {harness!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)")
        return None
sys.meta_path.insert(0, Block())
import ext_proc.service.app, ext_proc.envoy.server, ext_proc.feeds.probe, ext_proc.envoy.bootstrap
from ext_proc.cli import build_parser, main
commands = build_parser()._subparsers._group_actions[0].choices
print(sorted(commands))
for cmd in ("serve", "envoy-config"):
    try:
        main([cmd, "--help"])
    except SystemExit as e:
        assert e.code == 0, (cmd, e.code)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {harness!r})
assert not loaded, loaded
"""


def test_ext_proc_never_imports_the_harness() -> None:
    pattern = re.compile(r"^\s*(from|import) (emulator|loadgen)\b", re.M)
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "ext_proc").rglob("*.py")
        if pattern.search(p.read_text(encoding="utf-8"))
    ]
    assert offenders == []


def test_the_router_runs_without_the_harness() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(harness=HARNESS)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    # only the router's own subcommands: the harness's entry points could not load
    assert out.stdout.splitlines()[0] == "['envoy-config', 'serve']"
    assert "usage: gorgo serve" in out.stdout and "usage: gorgo envoy-config" in out.stdout


def test_the_harness_adds_its_subcommands() -> None:
    from ext_proc.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert {"serve", "envoy-config", "engine", "wan", "up", "demo", "replay", "simulate"} <= set(
        commands
    )
    bench = commands["bench"]._subparsers._group_actions[0].choices
    assert {"overhead", "results", "parity", "live", "load", "decide", "engine"} <= set(bench)
    assert "engine-model" in bench  # contributed by the emulator to the same group
