"""Gauges read from the router when Prometheus scrapes (no bookkeeping on the request
path): each backend's load, RTT, health, lifecycle, prefix state, the tuner's state."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ext_proc.common.build import package_version
from ext_proc.core.features import prefix_state
from ext_proc.core.router import Router
from ext_proc.director.flow_control import FLOW_OUTCOMES
from ext_proc.director.recipe import Director
from ext_proc.service.telemetry.prediction_metrics import (
    latency_prediction_gauges,
    served_model_gauges,
    step_model_gauges,
)
from ext_proc.vocab.types import BackendLifecycle, PrefixState


class LiveGauges(Collector):
    """Gauges read from the router at scrape time (no bookkeeping on the request path)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterable[Metric]:
        in_flight = GaugeMetricFamily("gorgo_in_flight", "Requests in flight", labels=["backend"])
        rtt = GaugeMetricFamily(
            "gorgo_rtt_seconds", "Smoothed probe RTT (seconds)", labels=["backend"]
        )
        suspect = GaugeMetricFamily("gorgo_suspect", "1 if probes fail", labels=["backend"])
        ejected = GaugeMetricFamily(
            "gorgo_ejected", "1 while ejected for failing requests", labels=["backend"]
        )
        ejections = CounterMetricFamily(
            "gorgo_ejections", "Ejections for failing requests", labels=["backend"]
        )
        now_s = self.router.clock()
        for b in self.router.backends.values():
            in_flight.add_metric([b.id], b.load.in_flight)
            rtt.add_metric([b.id], b.health.rtt_ms / 1000)
            suspect.add_metric([b.id], 1.0 if b.health.suspect else 0.0)
            # An ejection ends by itself (the state clears it at the next decision).
            ejected.add_metric([b.id], 1.0 if b.health.ejected_at(now_s) else 0.0)
            ejections.add_metric([b.id], b.health.ejections)
        report_age = GaugeMetricFamily(
            "gorgo_engine_report_age_seconds",
            "Seconds since the engine's last load report (/metrics) was read",
            labels=["backend"],
        )
        for b in self.router.backends.values():
            if b.engine.report_at_s is not None:
                report_age.add_metric([b.id], max(0.0, now_s - b.engine.report_at_s))
        weights = GaugeMetricFamily("gorgo_weight", "Current cost weights", labels=["name"])
        w = self.router.weights
        if w is not None:
            weights.add_metric(["rtt"], w.rtt)
            weights.add_metric(["queue"], w.queue)
        yield from (in_flight, rtt, suspect, ejected, ejections, report_age, weights)
        yield from self._tuner()
        yield from self._prefix_state()
        yield from latency_prediction_gauges(self.router.backends.values())
        yield from step_model_gauges(self.router.backends.values())
        yield from served_model_gauges(self.router.backends.values())
        yield self._lifecycle()

    def _lifecycle(self) -> GaugeMetricFamily:
        """Per backend, 1 for its lifecycle now and 0 for the others; the backends removed
        lately (Fleet.removed) show removed = 1."""
        g = GaugeMetricFamily(
            "gorgo_backend_lifecycle",
            "1 for the backend's lifecycle now (pending, active, draining, removed)",
            labels=["backend", "state"],
        )
        current = {b.id: b.lifecycle for b in self.router.backends.values()}
        for r in self.router.fleet.removed:
            current.setdefault(r["id"], BackendLifecycle.REMOVED)
        for backend, now in current.items():
            for state in BackendLifecycle:
                g.add_metric([backend, str(state)], 1.0 if state is now else 0.0)
        return g

    def _tuner(self) -> Iterable[Metric]:
        """The tuner's progress (nothing without a tuner)."""
        tuner = self.router.tuner
        if tuner is None:
            return
        steps = CounterMetricFamily(
            "gorgo_tuner_steps",
            "Tuner steps (rounds decided) by this process, by outcome",
            labels=["outcome"],
        )
        steps.add_metric(["accepted"], tuner.steps_accepted)
        steps.add_metric(["rejected"], tuner.steps_rejected)
        # the arms decided alike: no verdict (TunerSettings.tie_decisions)
        steps.add_metric(["tied"], tuner.steps_tied)
        samples = CounterMetricFamily(
            "gorgo_tuner_samples", "Completions the tuner scored (restored from its state file)"
        )
        samples.add_metric([], tuner.state.samples)
        frozen = GaugeMetricFamily(
            "gorgo_tuner_frozen", "1 while the tuner is frozen (parent serves all traffic)"
        )
        frozen.add_metric([], 1.0 if tuner.state.frozen else 0.0)
        sigma = GaugeMetricFamily("gorgo_tuner_sigma", "The tuner's mutation step size (log space)")
        sigma.add_metric([], tuner.state.sigma)
        yield from (steps, samples, frozen, sigma)

    def _prefix_state(self) -> Iterable[Metric]:
        """Per backend: whether its prefix state is the engine's own, and its event stream."""
        precise = GaugeMetricFamily(
            "gorgo_prefix_state_precise",
            "1 while the prefix state comes from the engine's KV events, 0: the router's own",
            labels=["backend"],
        )
        blocks = GaugeMetricFamily(
            "gorgo_kv_event_blocks", "Blocks the engine reports holding", labels=["backend"]
        )
        # counters (exported with _total): gaps, resets and dropped blocks only grow
        gaps = CounterMetricFamily(
            "gorgo_kv_event_gaps", "Gaps seen in the engine's event sequence", labels=["backend"]
        )
        resets = CounterMetricFamily(
            "gorgo_kv_event_resets", "Times the engine's state was reset", labels=["backend"]
        )
        lag = GaugeMetricFamily(
            "gorgo_kv_event_age_seconds",
            "Seconds since the engine's last event batch was stamped",
            labels=["backend"],
        )
        tokens_ok = GaugeMetricFamily(
            "gorgo_backend_tokens_ok",
            "1 while the router's token ids are known to be the engine's (events can match); "
            "0: they are not (no tokenizer, a mismatch, or not checked yet)",
            labels=["backend"],
        )
        warming = GaugeMetricFamily(
            "gorgo_prefix_state_warming",
            "1 while the engine's events are used but its earlier history may be missing "
            "(predictions are the events' or the router's own, whichever is more)",
            labels=["backend"],
        )
        unsupported = GaugeMetricFamily(
            "gorgo_kv_event_unsupported",
            "1 while the engine's event stream has a shape the router cannot key",
            labels=["backend"],
        )
        unknown = CounterMetricFamily(
            "gorgo_kv_event_unknown_parents",
            "Stored blocks dropped because their parent was never seen (the warm-start blind spot)",
            labels=["backend"],
        )
        now = time.time()  # event batches carry the engine's wall-clock stamp
        for b, st in self.router.backends.items():
            state = prefix_state(st)
            precise.add_metric([b], 1.0 if state is PrefixState.PRECISE else 0.0)
            engine = st.engine.blocks
            if engine is None:
                continue
            warming.add_metric([b], 1.0 if state is PrefixState.WARMING else 0.0)
            unsupported.add_metric([b], 0.0 if engine.unsupported is None else 1.0)
            unknown.add_metric([b], engine.health.unknown_parent_blocks)
            tokens_ok.add_metric([b], 1.0 if st.engine.tokens.ok else 0.0)
            blocks.add_metric([b], engine.blocks)
            gaps.add_metric([b], engine.gaps)
            resets.add_metric([b], engine.resets)
            if engine.last_ts is not None:
                lag.add_metric([b], max(0.0, now - engine.last_ts))
        yield from (precise, warming, blocks, gaps, resets, lag, tokens_ok, unsupported, unknown)


class FlowGauges(Collector):
    """The gateway queue (flow control), read at scrape time: requests waiting by band, the
    oldest wait, and what flow control did with each request, by outcome."""

    def __init__(self, director: Director) -> None:
        self.director = director

    def collect(self) -> Iterable[Metric]:
        waiting = GaugeMetricFamily(
            "gorgo_flow_waiting", "Requests waiting in the gateway queue", labels=["priority"]
        )
        oldest = GaugeMetricFamily(
            "gorgo_flow_oldest_wait_seconds", "How long the oldest waiting request has waited"
        )
        outcomes = CounterMetricFamily(
            "gorgo_flow_outcomes",
            "Requests through flow control: straight, released, cancelled, or refused by reason",
            labels=["outcome"],
        )
        state = self.director.admission.snapshot()
        if not state["enabled"]:
            return
        # Every configured band and every outcome, 0 included: a series exists from the
        # start (rates and alerts need one), not from the first request that waits.
        bands = {str(p): 0 for p in self.director.objectives.priorities()}
        for band, n in {**bands, **state["bands"]}.items():
            waiting.add_metric([band], n)
        oldest.add_metric([], state["oldest_wait_s"])
        for outcome, n in {**dict.fromkeys(FLOW_OUTCOMES, 0), **state["outcomes"]}.items():
            outcomes.add_metric([outcome], n)
        yield from (waiting, oldest, outcomes)


class BusGauges(Collector):
    """The fleet bus (several routers over NATS): whether this router hears the others
    (0: it decides on its own view alone), and its events by direction. Nothing without
    a bus. `snapshot` is the bus shell's (service.loops.fleet_bus)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any] | None]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        state = self.snapshot()
        if state is None:
            return
        connected = GaugeMetricFamily(
            "gorgo_bus_connected",
            "1 while this router is connected to the routers' NATS bus; 0: it runs alone",
        )
        connected.add_metric([], 1.0 if state["connected"] else 0.0)
        events = CounterMetricFamily(
            "gorgo_bus_events",
            "The routers' shared events: sent, received, dropped (queue full) or malformed",
            labels=["direction"],
        )
        for direction in ("sent", "received", "dropped", "malformed"):
            events.add_metric([direction], state[direction])
        yield from (connected, events)


class BuildInfo(Collector):
    """gorgo_build_info: 1, its labels what runs (the package's and Python's versions, the
    routing policy in force; a reload that changes the policy changes the label)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.version = package_version()
        self.python = platform.python_version()

    def collect(self) -> Iterable[Metric]:
        info = GaugeMetricFamily(
            "gorgo_build_info",
            "1: the router's version, its Python's, and the routing policy in force",
            labels=["version", "python_version", "policy"],
        )
        info.add_metric([self.version, self.python, self.router.cfg.policy], 1)
        yield info
