"""`gorgo simulate --engine-priority`: the simulated engines schedule by the priority each
request's class gives it, as SGLang's --enable-priority-scheduling does (the engine model's
own tests: tests/unit/emulator/engine/test_model_priority.py)."""

from pathlib import Path

import yaml

from emulator.engine.priority import PriorityScheduling
from ext_proc.estimate.profile import load_profile
from loadgen.sim.classes import classes_from_dict
from loadgen.sim.settings import SimSettings
from loadgen.sim.simulate import Simulation
from loadgen.traces.request import TraceRequest

CLASSES = classes_from_dict(
    {
        "objectives": [
            {"name": "interactive", "share": 0.25, "priority": 10, "ttft_slo_ms": 2000},
            {"name": "batch", "share": 0.75, "priority": 0},
        ]
    }
)


def burst(n: int) -> list[TraceRequest]:
    """n 4,000-token prompts sent at one instant, each its own conversation."""
    return [TraceRequest(i, 0.0, 4_000, 20, (50_000 + i,), 512, f"s{i}") for i in range(n)]


def two_slot_profile(tmp_path: Path) -> str:
    """The shipped profile with two batch slots: a burst waits in the engine."""
    raw = {**vars(load_profile()), "name": "two-slots", "max_running_requests": 2}
    path = tmp_path / "two-slots.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def run(tmp_path: Path, priority: PriorityScheduling | None) -> tuple[Simulation, dict[str, float]]:
    settings = SimSettings(
        policy="round_robin",
        regions=("ap-seoul",),
        engine_profile=two_slot_profile(tmp_path),
        classes=CLASSES,
        engine_priority=priority,
    )
    sim = Simulation(burst(24), settings)
    res = sim.run()
    mean: dict[str, float] = {}
    for name in ("interactive", "batch"):
        ttft = [r.ttft_ms or 0.0 for r in res.requests if r.objective == name]
        mean[name] = sum(ttft) / len(ttft)
    return sim, mean


def test_the_class_priority_reaches_the_engine_and_is_served_first(tmp_path: Path) -> None:
    off_sim, off = run(tmp_path, None)
    on_sim, on = run(tmp_path, PriorityScheduling())
    counts = on_sim.engines["ap-seoul"].stats.submitted_by_priority
    n_interactive = counts["10"]
    assert n_interactive >= 3 and counts["0"] == 24 - n_interactive
    # off: no priority reaches the engine; FCFS, both classes wait alike
    assert off_sim.engines["ap-seoul"].stats.submitted_by_priority == {"none": 24}
    assert on["interactive"] < 0.6 * off["interactive"]
    assert on["batch"] > off["batch"]
    # 10 over 0 is not past SGLang's threshold: nothing was preempted
    assert on_sim.engines["ap-seoul"].stats.preemptions == 0


def test_low_values_first_turns_the_sign(tmp_path: Path) -> None:
    sim, on = run(tmp_path, PriorityScheduling(low_values_first=True))
    assert set(sim.engines["ap-seoul"].stats.submitted_by_priority) == {"-10", "0"}
    _, off = run(tmp_path, None)
    assert on["interactive"] < 0.6 * off["interactive"]


def test_the_routers_read_the_engines_setting_as_from_server_info(tmp_path: Path) -> None:
    """With the engines' priority scheduling on, each router knows it as it would from
    SGLang's /server_info (`priority_scheduling: auto`): it writes the class there and
    predicts an interactive request's wait from the work of its class and above only."""
    sim, _ = run(tmp_path, PriorityScheduling(low_values_first=True))
    writing = sim.router.backends["ap-seoul"].priority
    assert writing.writes and writing.lower_first
    off_sim, _ = run(tmp_path, None)
    assert not off_sim.router.backends["ap-seoul"].priority.writes
