"""`gorgo bench live --fleet`: /state's per-backend prediction figures and the verdict."""

from typing import Any

from loadgen.bench.live.fleet import figures_from_state, figures_markdown, verdict


def _backend(completed: int, mape: float | None) -> dict[str, Any]:
    ttft = {"mape": mape, "bias_ms": None if mape is None else 12.5, "window": 128}
    return {
        "completed": completed,
        "speed": {"prefill_factor": 0.35, "decode_factor": 0.5},
        "latency_prediction": {"ttft": {**ttft, "requests": completed}, "e2e": dict(ttft)},
    }


def test_passes_only_with_every_backend_at_200_completions_within_15_percent() -> None:
    state = {"backends": {"a": _backend(210, 0.08), "b": _backend(250, 0.15)}}
    figs = figures_from_state(state)
    assert [f.backend for f in figs] == ["a", "b"]
    ok, line = verdict(figs)
    assert ok and line.startswith("PASS: worst TTFT MAPE 15.0%")
    assert "| a | 210 | 8.0% | +12 |" in figures_markdown(figs)

    ok, line = verdict(figures_from_state({"backends": {"a": _backend(199, 0.05)}}))
    assert not ok and "under 200 completions: a" in line
    ok, line = verdict(figures_from_state({"backends": {"a": _backend(300, 0.151)}}))
    assert not ok and "over target: a" in line
    ok, _ = verdict(figures_from_state({"backends": {"a": _backend(300, None)}}))
    assert not ok  # no figure is no pass
