"""The load generator's commands: each room registers its own parsers (its commands.py),
the benches once run by `python -m` are `gorgo bench` commands with their flags, and
building `gorgo`'s parser (which every command does, `gorgo serve` too) imports none of
the modules that run them."""

import re
import subprocess
import sys

from ext_proc.cli import build_parser
from loadgen import cli

# The modules a parser may import: each room's parsers, the benches' policy names.
LIGHT = {"commands", "policies"}


def _bench_parsers() -> dict[str, object]:
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    return commands["bench"]._subparsers._group_actions[0].choices


def test_every_room_adds_its_commands() -> None:
    names = [f.__name__ for f in (*cli.COMMANDS, *cli.BENCHES)]
    assert len(names) == len(set(names))
    assert {"add_demo", "add_replay", "add_simulate", "add_results", "add_target"} <= set(names)
    assert len(_bench_parsers()) == len(cli.BENCHES) + 1  # and the emulator's engine-model


def test_the_benches_once_run_by_python_m_are_gorgo_bench_commands() -> None:
    bench = _bench_parsers()
    flags = {
        "fleets": {"--fleets", "--time-scales", "--workers"},
        "learn": {"--trace", "--jobs", "--seeds", "--out"},
        "models": {"--trace", "--windows", "--time-scales", "--policies", "--seed", "--workers"},
        "kv-index": {"--tokens", "--repeat"},
        "screenshot": set(),
    }
    for name, expected in flags.items():
        own = {o for a in bench[name]._actions for o in a.option_strings}  # type: ignore[attr-defined]
        assert expected <= own, name
    args = build_parser().parse_args(["bench", "models", "--policies", "gorgo", "random"])
    assert args.policies == ["gorgo", "random"]
    args = build_parser().parse_args(["bench", "screenshot", "shot.png"])
    assert args.path == "shot.png"


def test_building_the_parser_imports_no_bench_simulator_or_replay() -> None:
    code = (
        "import sys; from ext_proc.cli import build_parser; build_parser(); "
        "print('\\n'.join(m for m in sys.modules if m.startswith(('loadgen', 'emulator'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    # a module of the benches, the simulator, the replay or the engine that runs something
    runs = re.compile(r"^(loadgen\.(bench(\.\w+)?|sim|replay)|emulator\.engine)\.\w+$")
    packages = {m.rpartition(".")[0] for m in out}
    heavy = [
        m for m in out if runs.match(m) and m not in packages and m.rpartition(".")[2] not in LIGHT
    ]
    assert "loadgen.bench.live.commands" in out
    assert heavy == []
    assert "emulator.stack.stack" not in out and "loadgen.client.stream" not in out
