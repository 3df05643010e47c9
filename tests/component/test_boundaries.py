"""The router runs without its harness: in a fresh interpreter where importing emulator/,
loadgen/ or matplotlib fails, as in an install without them, its modules load and its
subcommands work. The import checks themselves: tests/unit/test_boundaries.py."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ("emulator", "loadgen", "matplotlib")

# Runs in a fresh interpreter where importing the harness fails, as in an install without
# it: the router's modules and its subcommands must work.
PROBE = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {harness!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)")
        return None
sys.meta_path.insert(0, Block())
import ext_proc.service.app, ext_proc.service.epp.run
import ext_proc.envoy.server, ext_proc.envoy_config.bootstrap
import ext_proc.service.loops.probe, ext_proc.service.check.probes, ext_proc.service.check.judge
from ext_proc.cli import build_parser, main
commands = build_parser()._subparsers._group_actions[0].choices
print(sorted(commands))
for cmd in ("serve", "envoy-config", "check", "config-schema", "epp"):
    try:
        main([cmd, "--help"])
    except SystemExit as e:
        assert e.code == 0, (cmd, e.code)
assert main(["config-schema"]) == 0
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {harness!r})
assert not loaded, loaded
"""


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
    router_commands = "['check', 'config-schema', 'envoy-config', 'epp', 'serve']"
    assert out.stdout.splitlines()[0] == router_commands
    assert "usage: gorgo serve" in out.stdout and "usage: gorgo envoy-config" in out.stdout
    assert "usage: gorgo check" in out.stdout and "usage: gorgo config-schema" in out.stdout
