"""The result schema's prediction figures: per row the router's predicted TTFT and E2E,
in the summary their MAPE and bias after the first 20 % of the requests by arrival,
overall and per backend."""

from __future__ import annotations

import json

from loadgen.results import RequestResult, spearman_rho, summarize, write_result


def row(
    i: int, backend: str, predicted: float | None, ttft: float, status: str = "ok"
) -> RequestResult:
    return RequestResult(
        f"r{i}",
        backend,
        ttft_ms=ttft,
        e2e_ms=ttft * 10,
        status=status,
        predicted_ttft_ms=predicted,
        predicted_e2e_ms=None if predicted is None else predicted * 10 + 100,
    )


def test_prediction_figures_skip_the_warm_up_and_what_failed_or_was_not_predicted() -> None:
    rows = [
        row(0, "a", 1000.0, 100.0),  # the first 20 % (2 of 10): warm-up, left out
        row(1, "a", 1000.0, 100.0),
        row(2, "a", 120.0, 100.0),  # +20 ms, 20 %
        row(3, "a", 90.0, 100.0),  # -10 ms, 10 %
        row(4, "b", 150.0, 200.0),  # -50 ms, 25 %
        row(5, "b", 500.0, 100.0, status="error"),
        row(6, "b", None, 100.0),  # no prediction (a live replay's rows)
        row(7, "a", 100.0, 100.0),
        row(8, "b", 200.0, 200.0),
        row(9, "b", 250.0, 200.0),  # +50 ms, 25 %
    ]
    s = summarize(rows)
    assert s["ttft_prediction"] == {
        "mape": round(0.8 / 6, 6),
        "bias_ms": round(10 / 6, 3),
        "requests": 6,
        # ranks predicted 3 1 4 2 5 6 against measured 2 2 5 2 5 5 (ties averaged):
        # 13.5 / sqrt(17.5 x 13.5)
        "rho": round(13.5 / (17.5 * 13.5) ** 0.5, 4),
    }
    assert s["ttft_prediction_by_backend"] == {
        "a": {"mape": 0.1, "bias_ms": round(10 / 3, 3), "requests": 3},
        "b": {"mape": round(0.5 / 3, 6), "bias_ms": 0.0, "requests": 3},
    }
    # E2E: predicted 10 x + 100 ms against 10 x measured
    e2e = s["e2e_prediction"]
    assert e2e["requests"] == 6 and e2e["bias_ms"] == round(100 + 10 * 10 / 6, 3)
    assert set(s["e2e_prediction_by_backend"]) == {"a", "b"}


def test_without_predictions_the_figures_say_so(tmp_path) -> None:  # type: ignore[no-untyped-def]
    doc = write_result(tmp_path / "r.json", [RequestResult("x", "a", 10.0, 20.0)], {})
    assert doc["summary"]["ttft_prediction"] == {
        "mape": None,
        "bias_ms": None,
        "requests": 0,
        "rho": None,
    }
    assert doc["summary"]["ttft_prediction_by_backend"] == {}
    (saved,) = json.loads((tmp_path / "r.json").read_text())["requests"]
    assert saved["predicted_ttft_ms"] is None and saved["predicted_e2e_ms"] is None


def test_spearman_rho_ranks_not_values() -> None:
    assert spearman_rho([(1, 10), (2, 1000), (3, 1001)]) == 1.0  # monotone, not linear
    assert spearman_rho([(1, 3), (2, 2), (3, 1)]) == -1.0
    assert spearman_rho([(1, 1), (2, 2)]) is None  # too few to say
    assert spearman_rho([(1, 5), (2, 5), (3, 5)]) is None  # no spread
