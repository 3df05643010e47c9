"""What the router shows of itself (/state): per backend its record, queue estimate,
cached tokens, engine report, prefix state and prediction figures; the policy, weights,
tuner and the recent decisions (each with its outcome, once its request closed)."""

from __future__ import annotations

import time
from typing import Any

from ext_proc.core.backend import BackendState
from ext_proc.core.decision_log import DecisionLog
from ext_proc.core.features import Features, prefix_state
from ext_proc.core.state import FleetState
from ext_proc.learn.tuner import Tuner
from ext_proc.vocab.types import Weights

# How many of the recent decisions /state shows (the operator's page shows them all).
STATE_DECISIONS = 8


def prefix_state_json(b: BackendState, wall_s: float) -> dict[str, Any]:
    """Where the backend's cached-token prediction comes from, and its KV-event stream:
    per KV cache group its blocks, per DP rank its last sequence number, whether the
    router has the engine's whole history (warming until its predictions prove out),
    stores under a parent it never heard of, and why a stream is unusable."""
    out: dict[str, Any] = {"prefix_state": str(prefix_state(b))}
    engine = b.engine.blocks
    if engine is not None:
        out["kv_events"] = {
            "up": b.precise,
            "blocks": engine.blocks,
            "block_size": engine.block_size,
            "last_event_ts": engine.last_ts,
            # Seconds since that stamp (an idle engine publishes nothing).
            "age_s": None
            if engine.last_ts is None
            else round(max(0.0, wall_s - engine.last_ts), 3),
            "gaps": engine.gaps,
            "resets": engine.resets,
            **engine.as_json(wall_s),
        }
    return out


def snapshot(
    features: Features,
    policy: str,
    weights: Weights | None,
    tuner: Tuner | None,
    decisions: int,
    log: DecisionLog | None,
    pair_tuner: Tuner | None = None,
) -> dict[str, Any]:
    fleet = features.fleet
    now_s = features.clock()
    wall_s = time.time()  # KV event batches carry the engine's wall-clock stamp
    bt = fleet.cfg.routing.block_tokens
    backends = {}
    for b in fleet.state.backends.values():
        backends[b.id] = {
            **b.as_json(now_s),
            "queue_ms": round(features.queue_estimate_ms(b.id, now_s), 3),
            "cached_tokens": b.prefix.size_blocks * bt,
            # What the engine last said of its load, and how old that is (None: never).
            "engine": None
            if b.engine.report is None or b.engine.report_at_s is None
            else {**b.engine.report.as_json(), "age_s": round(now_s - b.engine.report_at_s, 3)},
            **prefix_state_json(b, wall_s),
            # How far its cached-token predictions were from the engine's reports.
            "prefix_prediction": b.learned.prediction.as_json(),
            # How far its TTFT and E2E predictions were from what came (MAPE, bias).
            "latency_prediction": b.learned.latency.as_json(),
            # The predicted decode's multiplier, by whether the output length was known.
            "decode_calibration": fleet.state.decode_calibration.backend_json(b.id),
            "lifecycle_age_s": round(now_s - b.lifecycle_since_s, 3),
        }
    return {
        "policy": policy,
        "weights": None if weights is None else {"rtt": weights.rtt, "queue": weights.queue},
        "tuner": None if tuner is None else tuner.snapshot(),
        "pair_tuner": None if pair_tuner is None else pair_tuner.snapshot(),
        "decisions": decisions,
        "in_flight": len(fleet.state.in_flight),
        **_pairs_json(fleet.state),
        "backends": backends,
        "removed_backends": fleet.removed_json(now_s),
        # The output lengths learned (the predicted decode's, estimate/output_length.py).
        "output_lengths": fleet.state.output_lengths.as_json(),
        "recent_decisions": None if log is None else log.as_json(STATE_DECISIONS),
    }


def _pairs_json(state: FleetState) -> dict[str, Any]:
    """A disaggregated fleet's: each request in flight still on its prefill engine (by
    request id: that engine, the decode engine, the predicted transfer), and each link's
    learned transfer factor; nothing for an aggregated fleet."""
    out: dict[str, Any] = {}
    if state.legs:
        out["prefilling"] = {
            rid: {
                "prefill": leg.backend,
                "decode": state.in_flight[rid].backend,
                "transfer_ms": round(state.in_flight[rid].transfer_ms, 3),
            }
            for rid, leg in state.legs.items()
            if rid in state.in_flight
        }
    factors = state.transfer.as_json()
    if factors:
        out["kv_transfer_factors"] = factors
    return out
