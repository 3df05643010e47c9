"""Fleet state as the router sees it: one record per backend (`core.backend.BackendState`,
kept and updated from outside by its base, core.records.BackendRecords) and the in-flight
tables, this router's and its peers'. Adding or removing a backend is one insert or one
delete here.

Pure and synchronous; every time comes from the caller (seconds on one monotonic clock).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque

from ext_proc.core.backend import BackendState
from ext_proc.core.records import BackendRecords
from ext_proc.estimate.decode_replay import DecodeCalibration
from ext_proc.estimate.output_length import OutputLengths
from ext_proc.estimate.transfer import TransferFactors
from ext_proc.vocab.types import InFlight, Status

# Weight of a new dispatch in a backend's mean prefill estimate (prices engine-reported
# queue lengths): about the last 20 requests.
PREFILL_EWMA = 0.05
# A request whose completion has not come this many times its predicted E2E, plus the
# floor, after its dispatch was lost (an Envoy that never reported it, a dropped log
# entry): closed then, so it stops loading its backend's queue estimate, not only after
# request_timeout_s. Generous: a prediction can be short several times over near
# saturation, and a live request closed early only loses its learning.
LOST_AFTER_E2E_FACTOR = 10.0
LOST_AFTER_FLOOR_S = 60.0


class FleetState(BackendRecords):
    """Per-backend counters plus the in-flight tables, kept consistent with each other."""

    def __init__(self) -> None:
        super().__init__()
        # Insertion order = dispatch order, so the oldest records expire first.
        self.in_flight: OrderedDict[str, InFlight] = OrderedDict()
        # What other routers dispatched (shared over the routers' bus): it loads
        # the backends' counters and queues like our own, and nothing learns from it.
        self.peer_in_flight: OrderedDict[str, InFlight] = OrderedDict()
        # The output lengths learned from this router's completions (the decode's
        # prediction, estimate/output_length.py).
        self.output_lengths = OutputLengths()
        # The predicted decode's calibration to the E2E's relative error, per backend.
        self.decode_calibration = DecodeCalibration()
        # The prefill legs of disaggregated requests in flight (by request id): each loads
        # its prefill engine from the dispatch until its own answer (`prefill_done`), the
        # decode's first byte (its KV has been sent then) or the request's close,
        # whichever comes first.
        self.legs: dict[str, InFlight] = {}
        # Each leg until its own answer reaches the router (`prefill_done`) or the request
        # closes: what that answer teaches of the prefill engine's speed.
        self.leg_of: dict[str, InFlight] = {}
        # The links' transfers as observed against their prediction (per pair of regions).
        self.transfer = TransferFactors()

    def dispatch(self, rec: InFlight, leg: InFlight | None = None) -> None:
        """Count a request in flight; `leg`: its prefill on another engine (counted there
        until `release_leg`)."""
        old = self.in_flight.pop(rec.request_id, None)
        if old is not None:  # a reused request id: the older record can no longer complete
            self._drop_load(old)
            self._end_leg(rec.request_id)
        # Another router's request with the same id (ids are the clients' or Envoy's, not
        # unique across routers): the id is ours now, and one record holds it (else the
        # backend counted it twice, and the peer's close released our record).
        self.peer_close(rec.request_id)
        self.in_flight[rec.request_id] = rec
        b = self._add_load(rec)
        b.load.mean_prefill_ms += PREFILL_EWMA * (rec.prefill_ms - b.load.mean_prefill_ms)
        if leg is not None:
            self.legs[rec.request_id] = self.leg_of[rec.request_id] = leg
            p = self._add_load(leg)
            p.load.mean_prefill_ms += PREFILL_EWMA * (leg.prefill_ms - p.load.mean_prefill_ms)

    def release_leg(self, request_id: str) -> InFlight | None:
        """The prefill engine is done with the request (its KV sent, or the request
        ended): its load there is dropped, once (None: no leg, or already released)."""
        leg = self.legs.pop(request_id, None)
        if leg is not None and leg.backend in self.backends:
            self._drop_load(leg)
        return leg

    def prefill_done(self, request_id: str, now_s: float, kv_sent: bool) -> None:
        """The request's prefill leg answered the router: its prefill engine is done with
        it (its load there dropped, if the decode's first byte has not dropped it yet), and
        the leg's engine time (from the dispatch, less the trip, the pacing and, when the
        answer followed the KV (`kv_sent`), the transfer as predicted) against the
        profile's queue and prefill (and its replay's, ttft_model: replay) teaches that
        engine's prefill speed, as a TTFT teaches an aggregated engine's
        (core.learners.SpeedLearner)."""
        leg = self._end_leg(request_id)
        rec = self.in_flight.get(request_id)
        b = None if leg is None else self.backends.get(leg.backend)
        if leg is None or rec is None or b is None:
            return
        engine_ms = (now_s - leg.dispatched_s) * 1000.0 - leg.rtt_ms - rec.pace_ms
        if kv_sent:
            engine_ms -= rec.transfer_ms
        b.learn_prefill(leg, max(0.0, engine_ms))

    def _end_leg(self, request_id: str) -> InFlight | None:
        """The request is done with its prefill leg: its load dropped (if still counted)
        and its record forgotten; the record (None: none)."""
        self.release_leg(request_id)
        return self.leg_of.pop(request_id, None)

    def _learn_transfer(self, rec: InFlight, now_s: float) -> None:
        """The decode's first byte came: what the transfer took is the time from the
        dispatch less every other part of the prediction (its queues, prefill, first step
        and trips); its bandwidth part, set against the predicted one, moves the link's
        factor."""
        if rec.prefill_backend is None or rec.predicted_ttft_ms is None or not rec.streaming:
            return
        elapsed_ms = (now_s - rec.dispatched_s) * 1000.0 - rec.pace_ms
        observed_ms = max(0.0, elapsed_ms - (rec.predicted_ttft_ms - rec.transfer_ms))
        rec.observed_transfer_ms = observed_ms
        p, d = self.backends.get(rec.prefill_backend), self.backends.get(rec.backend)
        if p is None or d is None or rec.transfer_bandwidth_ms < 1.0:  # too small to tell
            return
        link_rtt_ms = rec.transfer_ms - rec.transfer_bandwidth_ms
        self.transfer.observe(
            p.config.region, d.config.region, rec.transfer_bandwidth_ms, observed_ms - link_rtt_ms
        )

    def first_byte(self, request_id: str, now_s: float) -> tuple[float, InFlight] | None:
        """Mark the first response byte: TTFT in ms and the record (None if unknown or
        repeated)."""
        rec = self.in_flight.get(request_id)
        if rec is None or rec.first_byte_s is not None:
            return None
        ttft_ms = (now_s - rec.arrived_s) * 1000.0  # its wait in the gateway queue included
        if rec.ended_e2e_ms is not None:
            ttft_ms = min(ttft_ms, rec.ended_e2e_ms)
        rec.first_byte_s = rec.arrived_s + ttft_ms / 1000.0
        self.backends[rec.backend].load.waiting_first_byte -= 1  # where it is counted
        self.release_leg(request_id)  # the decode began: the KV came
        self._learn_transfer(rec, now_s)
        served = self.backends.get(rec.served_by or rec.backend, self.backends[rec.backend])
        served.stats.recent_ttft_ms.append(ttft_ms)  # the backend that answered
        return ttft_ms, rec

    def served_elsewhere(self, request_id: str, backend: str | None) -> str | None:
        """The backend other than the chosen one serving a request in flight: `backend`
        when given, else the one said before; kept on its record (None: the chosen one,
        or not known)."""
        rec = self.in_flight.get(request_id)
        if rec is None:
            return None
        backend = backend or rec.served_by
        if not backend or backend == rec.backend:
            return None
        rec.served_by = backend
        return backend

    def close(
        self,
        request_id: str,
        now_s: float,
        status: Status,
        e2e_ms: float | None = None,
        reason: str = "",
        served_ok: bool = False,
    ) -> tuple[InFlight, float] | None:
        """Close a request's record: the record and its E2E in ms (measured here when the
        caller has none). None if it was not in flight (already closed). `served_ok`: a
        failed-over request the other backend (`rec.served_by`) answered with success: its
        E2E is that backend's."""
        rec = self.in_flight.pop(request_id, None)
        if rec is None:
            return None
        self._drop_load(rec)
        self._end_leg(request_id)  # ended, maybe before its decode's first byte
        b = self.backends[rec.backend]
        measured_e2e_ms = e2e_ms if e2e_ms is not None else (now_s - rec.arrived_s) * 1000.0
        if status == Status.FAILED_OVER:  # only the failure to connect was the chosen one's
            b.stats.failovers += 1
            b.health.request_failures += 1
            b.health.failed_dispatch_s = max(b.health.failed_dispatch_s, rec.arrived_s)
            b.health.recent_failures.append(f"failed over: {reason}" if reason else "failed over")
            served = self.backends.get(rec.served_by or "")
            if served is not None and served_ok:
                served.stats.completed += 1
                served.stats.recent_e2e_ms.append(measured_e2e_ms)
        elif status == Status.OK:
            b.stats.completed += 1
            b.stats.recent_e2e_ms.append(measured_e2e_ms)
        elif status == Status.ERROR:
            b.stats.errors += 1
            b.health.recent_failures.append(reason or "error")
        else:
            counter = _OTHER_COUNTERS[status]
            setattr(b.stats, counter, getattr(b.stats, counter) + 1)
        end_s = rec.arrived_s + measured_e2e_ms / 1000.0
        if rec.first_byte_s is not None and rec.first_byte_s > end_s:
            # The first chunk's message reached the router after the response ended (a
            # short response, a busy loop): Envoy timed the whole exchange, and the first
            # byte came before the last.
            late_ms = (rec.first_byte_s - rec.arrived_s) * 1000.0
            rec.first_byte_s = end_s
            _replace_last(b.stats.recent_ttft_ms, late_ms, measured_e2e_ms)
        # A cancelled client or a bad request says nothing about the backend.
        h = b.health
        if status == Status.ERROR:
            h.request_failures += 1
            h.failed_dispatch_s = max(h.failed_dispatch_s, rec.arrived_s)
        elif status == Status.OK and rec.arrived_s >= h.failed_dispatch_s:
            h.request_failures = 0
        return rec, measured_e2e_ms

    def own_in_flight(self, backend: str) -> int:
        """This router's requests in flight on the backend (its peers' not counted)."""
        return sum(1 for rid in self.backends[backend].load.records if rid in self.in_flight)

    def remove(self, backend: str) -> BackendState:
        """Forget a backend that has none of this router's requests in flight; its peers'
        (other routers' requests there) are forgotten with it."""
        if self.own_in_flight(backend):
            raise ValueError(f"backend {backend!r} has requests in flight")
        b = self.backends.pop(backend)
        for rid in list(b.load.records):
            self.peer_in_flight.pop(rid, None)
        return b

    def peer_dispatch(self, rec: InFlight) -> None:
        if rec.request_id in self.in_flight or rec.backend not in self.backends:
            return  # our own (a bus echo), or a backend this router does not route to
        self.peer_close(rec.request_id)
        self.peer_in_flight[rec.request_id] = rec
        self._add_load(rec)

    def peer_first_byte(self, request_id: str, now_s: float) -> None:
        rec = self.peer_in_flight.get(request_id)
        if rec is not None and rec.first_byte_s is None:
            rec.first_byte_s = now_s
            self.backends[rec.backend].load.waiting_first_byte -= 1

    def peer_close(self, request_id: str) -> None:
        rec = self.peer_in_flight.pop(request_id, None)
        if rec is not None:
            self._drop_load(rec)

    def expire_peers(self, now_s: float, timeout_s: float) -> int:
        """Forget peers' requests in flight for timeout_s (their close was lost)."""
        old = []
        for rec in self.peer_in_flight.values():  # arrival order: stop at the first young one
            if now_s - rec.dispatched_s < timeout_s:
                break
            old.append(rec.request_id)
        for request_id in old:
            self.peer_close(request_id)
        return len(old)

    def overdue(self, now_s: float, timeout_s: float) -> list[str]:
        """Requests in flight past their deadline (their completion was lost): several
        times their predicted E2E, never more than timeout_s."""
        return [
            rec.request_id
            for rec in self.in_flight.values()
            if now_s - rec.dispatched_s >= lost_after_s(rec, timeout_s)
        ]

    def late_backends(self, now_s: float, grace_ms: float) -> set[str]:
        """Backends with one of this router's requests waiting for its first byte more
        than grace_ms past when it was due (dispatch + its predicted TTFT)."""
        return {
            r.backend
            for r in self.in_flight.values()
            if r.first_byte_s is None
            and r.streaming
            and r.predicted_ttft_ms is not None
            and now_s - r.dispatched_s > (r.pace_ms + r.predicted_ttft_ms + grace_ms) / 1e3
        }

    def missed_first_byte(self, now_s: float) -> list[InFlight]:
        """Requests whose backend let their first-byte deadline pass (each once): their
        backends are suspect (a probe that answers clears it), and Envoy gives up on them
        there."""
        missed = [
            r
            for r in self.in_flight.values()
            if r.first_byte_s is None
            and r.first_byte_deadline_s is not None
            and now_s > r.first_byte_deadline_s
        ]
        for r in missed:
            r.first_byte_deadline_s = None
            self.backends[r.backend].health.suspect = True
        return missed

    def _add_load(self, rec: InFlight) -> BackendState:
        """Count a request in flight on its backend (undone by _drop_load)."""
        b = self.backends[rec.backend]
        b.load.records[rec.request_id] = rec
        b.load.in_flight += 1
        b.load.waiting_first_byte += 1
        b.load.in_flight_tokens += rec.input_tokens
        return b

    def _drop_load(self, rec: InFlight) -> None:
        b = self.backends[rec.backend]
        del b.load.records[rec.request_id]
        b.load.in_flight -= 1
        b.load.in_flight_tokens -= rec.input_tokens
        if rec.first_byte_s is None:
            b.load.waiting_first_byte -= 1


# The counter each status that is neither a success nor the backend's failure adds to.
_OTHER_COUNTERS = {
    Status.CLIENT_ERROR: "client_errors",
    Status.CANCELLED: "cancelled",
    Status.GATEWAY_ERROR: "gateway_errors",
    Status.EXPIRED: "lost",
    Status.LOST: "lost",
}


def lost_after_s(rec: InFlight, timeout_s: float) -> float:
    """How long after its dispatch a request without a completion is taken as lost."""
    if rec.predicted_e2e_ms is None:
        return timeout_s
    return min(timeout_s, LOST_AFTER_E2E_FACTOR * rec.predicted_e2e_ms / 1e3 + LOST_AFTER_FLOOR_S)


def _replace_last(values: deque[float], old: float, new: float) -> None:
    """Replace the most recent occurrence of `old` (if it is still there)."""
    for i in range(len(values) - 1, -1, -1):
        if math.isclose(values[i], old, rel_tol=1e-9, abs_tol=1e-6):
            values[i] = new
            return
