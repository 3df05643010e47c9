"""`gorgo simulate`'s flags: --weights, --no-learn, --fleet and --router-knows-fleet
reach the simulation's settings, and bad values fail before any simulating."""

import argparse
from pathlib import Path

import pytest

from ext_proc.cli import build_parser
from loadgen.sim.commands import _sim_router, _weights

FLEETS = Path(__file__).resolve().parents[4] / "loadgen/data/fleets"


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["simulate", "paper-synthetic", *argv])


def test_weights_are_two_positive_numbers() -> None:
    assert _weights("2,0.5") == (2.0, 0.5)
    for bad in ("1", "1,2,3", "a,b", "0,1", "1,-1", "nan,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            _weights(bad)


def test_weights_and_no_learn_become_router_config() -> None:
    assert _sim_router(_args()) == {}
    router = _sim_router(_args("--weights", "4,0.25", "--no-learn"))
    assert router == {
        "policies": {"gorgo": {"weights": {"rtt": 4.0, "queue": 0.25}}},
        "routing": {"learn_latency": False},
    }


def test_the_router_starts_from_the_weights_given() -> None:
    from loadgen.sim.settings import SimSettings
    from loadgen.sim.simulate import Simulation

    sim = Simulation([], SimSettings(router=_sim_router(_args("--weights", "4,0.25"))))
    assert (sim.router.weights.rtt, sim.router.weights.queue) == (4.0, 0.25)


def test_bad_flags_fail_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _args("--weights", "0,1")
    assert e.value.code == 2
    assert "both weights must be > 0" in capsys.readouterr().err
    args = _args("--router-knows-fleet")
    assert args.func(args) == 2
    assert "--router-knows-fleet needs --fleet" in capsys.readouterr().err
    args = _args("--fleet", str(FLEETS / "nope.yaml"))
    assert args.func(args) == 2
    assert "fleet " in (err := capsys.readouterr().err) and "nope.yaml" in err


def test_pd_flags_reach_the_simulation_and_its_result_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    head = FLEETS.parent / "mooncake-conversation-head400.jsonl"
    argv = ["--limit", "40", "--time-scale", "3", "--out", str(tmp_path), "--pd"]
    args = build_parser().parse_args(["simulate", str(head), *argv, "--kv-link-gbps", "25"])
    assert args.func(args) == 0
    pd = json.loads((tmp_path / "gorgo-ts3.json").read_text())["meta"]["pd"]
    assert pd["layout"] == "pd" and pd["kv_link_gbps"] == 25.0 and pd["prefills_apart"] == 40
    args = build_parser().parse_args(["simulate", str(head), *argv, "--kv-link-gbps", "0"])
    assert args.func(args) == 2
    assert "kv_link_gbps: must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one layout or the other
        build_parser().parse_args(["simulate", str(head), "--pd", "--pd-aggregated"])


def test_gorgos_p_d_knobs_become_its_policy_config() -> None:
    router = _sim_router(_args("--local-threshold-tokens", "4096", "--remote-margin-ms", "25"))
    assert router == {
        "policies": {"gorgo": {"local_threshold_tokens": 4096, "remote_margin_ms": 25.0}}
    }
    both = _sim_router(_args("--weights", "2,1", "--remote-margin-ms", "5"))
    assert both["policies"] == {
        "gorgo": {"weights": {"rtt": 2.0, "queue": 1.0}, "remote_margin_ms": 5.0}
    }
