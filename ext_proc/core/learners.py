"""What learns from each request's outcome, as lifecycle listeners of the router."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from ext_proc.config.schema import Routing
from ext_proc.core.state import FleetState
from ext_proc.estimate.decode_replay import length_kind
from ext_proc.estimate.latency_model import MIN_DECODE_TOKENS
from ext_proc.estimate.output_length import keys_for
from ext_proc.estimate.prediction import prediction_error
from ext_proc.estimate.profile import EngineProfile
from ext_proc.learn.settings import EXCESS_TTFT
from ext_proc.learn.tuner import Tuner
from ext_proc.vocab.events import Closed, Dispatched, Listener
from ext_proc.vocab.types import Candidate, PrefixState, Status, Weights

log = logging.getLogger("gorgo.router")

# Ends that mean the chosen engine computed nothing of the prompt: it refused it (4xx:
# too long, malformed) or another backend served it (Envoy failed over).
NO_PREFILL = frozenset({Status.CLIENT_ERROR, Status.FAILED_OVER})
# A block the router believed cached for this long that the engine no longer had was
# evicted (any prefill that could still be computing it is long over): see `learn_cached`.
SETTLED_S = 30.0


class PrefixLearner(Listener):
    """Keeps the prefix index: optimistic insert at dispatch (the prefill will compute
    those blocks), insert where a failed-over request was really served, and trim when
    the engine reports fewer cached tokens than the index claimed."""

    def __init__(self, state: FleetState, block_tokens: int) -> None:
        self.state = state
        self.block_tokens = block_tokens

    def on_dispatch(self, e: Dispatched) -> None:
        if e.record.blocks is not None:
            self.state.backends[e.record.backend].prefix.insert(e.record.blocks, e.now_s)
            if e.record.prefill_backend in self.state.backends:  # it computes them
                self.state.backends[e.record.prefill_backend].prefix.insert(
                    e.record.blocks, e.now_s
                )

    def on_close(self, e: Closed) -> None:
        rec = e.record
        if e.status in NO_PREFILL and rec.first_byte_s is None and rec.blocks is not None:
            # what the dispatch inserted was never computed there
            held = rec.cached_tokens // self.block_tokens
            self.state.backends[rec.backend].prefix.forget(rec.blocks[held:], rec.dispatched_s)
        if e.status == Status.FAILED_OVER and e.served_by and rec.blocks is not None:
            # its KV is there now
            self.state.backends[e.served_by].prefix.insert(rec.blocks, e.now_s)
        elif e.status == Status.OK and e.cached_tokens is not None:
            self.learn_cached(e)

    def learn_cached(self, e: Closed) -> int:
        """The engine reported how much of the prompt it had cached. If that is less than
        the index claimed, the engine evicted a block the index still holds; an LRU cache
        evicts older blocks first, so everything not used since that block goes too.
        Returns how many index blocks were dropped."""
        rec = e.record
        held = rec.matched_last_used_s
        kept = (e.cached_tokens or 0) // self.block_tokens
        if held is None or kept >= len(held):
            return 0
        missing_last_used_s = float(held[kept])
        if rec.dispatched_s - missing_last_used_s < SETTLED_S:
            return 0  # maybe still being computed by an earlier request: not evidence
        return self.state.backends[rec.backend].prefix.trim(missing_last_used_s)


class SpeedLearner(Listener):
    """Teaches each backend's latency model (ext_proc/estimate/latency_model.py) from its
    streamed completions: the engine's part of the TTFT (TTFT - RTT) against what the
    profile predicted for it (queue + prefill, without the model's factor), and the mean
    decode step against the profile's mean step over its replayed decode. The output count
    is the one generated when the caller reports it (the simulator), else the one expected
    (its max_tokens, or learned): a step read off when the expectation was."""

    def __init__(self, state: FleetState) -> None:
        self.state = state

    def on_close(self, e: Closed) -> None:
        rec = e.record
        b = self.state.backends.get(rec.backend)
        if (
            b is None
            or e.status != Status.OK
            or e.ttft_ms is None
            or not rec.streaming
            or rec.predicted_ttft_ms is None
            or rec.predicted_e2e_ms is None
        ):
            return
        if rec.prefill_backend is not None:  # its TTFT is two engines' and a link's
            self._learn_decode(e)
            return
        # its prediction counts from the dispatch: not its wait in the gateway queue
        b.learn_prefill(rec, e.ttft_ms - rec.waited_ms - rec.rtt_ms - rec.pace_ms)
        self._learn_decode(e)

    def _learn_decode(self, e: Closed) -> None:
        rec = e.record
        assert rec.predicted_ttft_ms is not None and rec.predicted_e2e_ms is not None
        assert e.ttft_ms is not None
        speed = self.state.backends[rec.backend].speed_for(rec.model)
        # The mean step predicted (its decode replay over the output it was expected to
        # generate, in profile ms) against the mean step it had over the output it did
        # generate (the expected output when the count is not known).
        expected = rec.expected_output_tokens or rec.output_tokens
        out = round(expected) if rec.generated_tokens is None else rec.generated_tokens
        if out >= MIN_DECODE_TOKENS and expected >= 2:
            decode_ms = (rec.predicted_e2e_ms - rec.predicted_ttft_ms) / rec.decode_calibration
            step_ms = decode_ms / (expected - 1) / rec.decode_factor
            speed.observe_decode(step_ms, (e.e2e_ms - e.ttft_ms) / (out - 1))


class OutputLearner(Listener):
    """Learns the output lengths (estimate/output_length.py) from the completions whose
    generated token count is known, by the request's model, objective and tenant; and
    each backend's decode calibration from every completion's E2E
    (estimate/decode_replay.py DecodeCalibration)."""

    def __init__(self, state: FleetState) -> None:
        self.state = state

    def on_close(self, e: Closed) -> None:
        if e.status != Status.OK:
            return
        rec = e.record
        if (
            rec.expected_output_tokens is not None
            and rec.predicted_e2e_ms is not None
            and rec.predicted_ttft_ms is not None
        ):
            kind = length_kind(rec.expected_output_tokens, rec.max_output_tokens)
            self.state.decode_calibration.observe(
                (rec.backend, kind),
                rec.predicted_e2e_ms + rec.waited_ms,
                rec.predicted_e2e_ms - rec.predicted_ttft_ms,
                e.e2e_ms,
            )
        if rec.generated_tokens is None:
            return
        keys = keys_for(rec.model, rec.objective, rec.tenant)
        lengths = self.state.output_lengths
        lengths.observe(keys, rec.generated_tokens, rec.max_output_tokens, rec.session)


class Ejector(Listener):
    """Passive health: ejects a backend after eject_after_errors failures in a row."""

    def __init__(self, state: FleetState, routing: Routing) -> None:
        self.state = state
        self.after = routing.eject_after_errors
        self.eject_s = routing.eject_s

    def on_close(self, e: Closed) -> None:
        if self.after and self.state.eject_failing(e.backend, e.now_s, self.after, self.eject_s):
            failures = self.state.backends[e.backend].health.recent_failures
            log.warning(
                "backend %s ejected: %d failed or unreachable requests in a row (%s)",
                e.backend,
                self.after,
                "; ".join(failures),
            )


class PredictionLearner(Listener):
    """Each backend's prediction figures: the cached tokens predicted on the chosen
    backend against what its engine reported at completion; its TTFT and E2E predicted
    against those measured (LatencyStats); and, while its KV events are warming, whether
    a precise prediction would have been right (EngineBlocks.settle)."""

    def __init__(self, state: FleetState) -> None:
        self.state = state

    def on_close(self, e: Closed) -> None:
        err = prediction_error(e)
        b = self.state.backends[e.backend]
        if e.record.prefix_state == PrefixState.WARMING and b.engine.blocks is not None:
            b.engine.blocks.settle(e.request_id, None if err is None else err.reported_tokens)
        if err is not None:
            b.learned.prediction.add(e.record.prefix_state, err)
        b.learned.latency.observe(e)


# Ends that say nothing of how good the weights' choice was.
NOT_THE_WEIGHTS = frozenset(
    {Status.CANCELLED, Status.CLIENT_ERROR, Status.GATEWAY_ERROR, Status.LOST}
)

# A weighted policy's `would_pick(candidates, weights, backend)`: would those weights
# choose that backend too (policy.gorgo)?
WouldPick = Callable[[Sequence[Candidate], Weights, str], bool]


class TunerLearner(Listener):
    """Scores the tuner's arms. A request that failed (error, expiry, failover) counts
    against the arm that routed it as if it had waited `failure_ms`; a cancelled, bad,
    refused or lost request says nothing about the weights and is only forgotten.

    With each success goes the request's floor, for the `excess_ttft` objective: the
    prefill of its whole prompt, uncached, on an idle engine, with the fastest of the
    fleet's profiles (`profiles`, the router's live map). No weight changes it: it depends
    on neither the chosen backend's RTT, nor its queue, nor its cache.

    At each dispatch, given the policy's `would_pick`, it tells the tuner whether the
    other arm's weights would have chosen the same backend (`Tuner.decided`)."""

    def __init__(
        self,
        tuner: Tuner,
        failure_ms: float,
        profiles: Mapping[str, EngineProfile] | None = None,
        would_pick: WouldPick | None = None,
    ) -> None:
        self.tuner = tuner
        self.failure_ms = failure_ms
        self.profiles = profiles if profiles is not None else {}
        self.would_pick = would_pick

    def on_dispatch(self, e: Dispatched) -> None:
        """Tells the tuner whether the other arm's weights would have decided alike."""
        d = e.decision
        other = self.tuner.other_weights(d.request_id)
        if other is not None and self.would_pick is not None:
            self.tuner.decided(d.request_id, self.would_pick(d.candidates, other, d.backend))

    def floor_ms(self, input_tokens: int) -> float:
        """What the prompt alone costs: its TTFT on the fastest idle engine, nothing cached."""
        if input_tokens <= 0 or not self.profiles:
            return 0.0
        return min(p.lone_ttft_ms(input_tokens) for p in self.profiles.values())

    def on_close(self, e: Closed) -> None:
        if e.status == Status.OK:
            floor = 0.0
            if self.tuner.s.objective == EXCESS_TTFT:
                floor = self.floor_ms(e.record.input_tokens)
            # the weights chose the backend, not the wait in the gateway queue before it
            waited_ms = e.record.waited_ms
            ttft_ms = None if e.ttft_ms is None else e.ttft_ms - waited_ms
            self.tuner.observe(e.request_id, ttft_ms, e.e2e_ms - waited_ms, floor)
        elif e.status in NOT_THE_WEIGHTS:
            self.tuner.forget(e.request_id)
        else:
            self.tuner.observe(e.request_id, self.failure_ms, self.failure_ms)
