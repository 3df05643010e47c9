"""What the router hears besides Envoy's decisions (`RouterInputs`, the router's
`inputs`): the engines' KV events, RTT probes, engine load reports, fallback completions,
the endpoint that served a request, the models each engine serves, whether the router's
token ids are an engine's, and the other routers' dispatches. Each goes into the fleet's
records; a backend removed meanwhile ignores it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ext_proc.core.backend import TokenCheck
from ext_proc.core.fleet import Fleet
from ext_proc.estimate.engine_index import Applied, EngineBlocks
from ext_proc.feeds.engine_metrics import EngineReport
from ext_proc.feeds.kv_events import EventBatch
from ext_proc.feeds.peers import PeerEvent, PeerKind
from ext_proc.feeds.served_models import ServedModels
from ext_proc.feeds.server_info import EngineScheduling
from ext_proc.prompt.parse import event_bytes, streamed_tokens
from ext_proc.vocab.types import InFlight


class RouterInputs:
    """The router's `inputs`: what it hears of the backends besides its decisions and
    their closes (KV events, probes, load reports, model lists, token checks, fallback
    completions, other routers), written into the fleet's records on the router's clock."""

    __slots__ = ("_fleet", "clock")

    def __init__(self, fleet: Fleet, clock: Callable[[], float]) -> None:
        self._fleet = fleet
        self.clock = clock

    def apply_kv_events(self, backend: str, batch: EventBatch) -> Applied:
        """One batch from the backend's engine, in order (see EngineBlocks.apply); a
        backend removed meanwhile, or one without events, ignores it."""
        b = self._fleet.state.backends.get(backend)
        return Applied() if b is None or b.engine.blocks is None else b.engine.blocks.apply(batch)

    def apply_keyed_kv_events(
        self, backend: str, block_size: int, changes: Sequence[tuple[object, ...]]
    ) -> None:
        """Changes from an engine whose blocks are keyed as the caller keys prompts (the
        simulator's engine models): see EngineBlocks.apply_keyed."""
        engine = self._fleet.state.backends[backend].engine.blocks
        if engine is not None:
            engine.apply_keyed(block_size, changes)

    def expect_engine_events(self, backend: str) -> None:
        """The backend's engine reports its blocks from now on, whatever its config says
        (the simulator's engines); the stream starts up."""
        b = self._fleet.state.backends[backend]
        if b.engine.blocks is None:
            b.engine.blocks = EngineBlocks()
        b.engine.events_up = True

    def set_event_stream(self, backend: str, up: bool) -> None:
        """The backend's event stream is up (its state is the engine's) or down (the
        router's own estimate serves it until it is back)."""
        b = self._fleet.state.backends.get(backend)
        if b is not None:
            b.engine.events_up = up and b.engine.blocks is not None

    def apply_peer(self, e: PeerEvent) -> None:
        """Another router's lifecycle event: its requests load our view of the backends
        (queue estimates, in-flight counts) as our own do; nothing learns from them."""
        state = self._fleet.state
        if e.kind == PeerKind.DISPATCHED:
            state.peer_dispatch(
                InFlight(
                    request_id=e.request_id,
                    backend=e.backend,
                    dispatched_s=self.clock(),
                    input_tokens=e.input_tokens,
                    output_tokens=e.output_tokens,
                    cached_tokens=e.cached_tokens,
                    prefill_ms=e.prefill_ms,
                    rtt_ms=e.rtt_ms,
                    queue_ms=e.queue_ms,
                    streaming=e.streaming,
                )
            )
        elif e.kind == PeerKind.FIRST_BYTE:
            state.peer_first_byte(e.request_id, self.clock())
        elif e.kind == PeerKind.CLOSED:
            state.peer_close(e.request_id)
        # (WAITING is the gateway queue's: director.flow_control.FlowController.hear_claims)

    def record_probe(self, backend: str, rtt_ms: float | None) -> None:
        """A probe answered in rtt_ms, or failed (None). One failure is enough to make a
        backend suspect when a request there is late for its first byte too (a link
        that swallows everything); probes alone need probes.suspect_after."""
        p = self._fleet.cfg.probes
        after = p.suspect_after
        if rtt_ms is None and backend in self.late_backends():
            after = 1
        self._fleet.state.record_probe(backend, rtt_ms, p.ewma_alpha, after)

    def late_backends(self) -> set[str]:
        """Backends with a request still waiting for its first byte past the time it was
        due, beyond routing.stall_grace_ms: worth a probe now."""
        return self._fleet.state.late_backends(self.clock(), self._fleet.cfg.routing.stall_grace_ms)

    def record_engine_report(self, backend: str, report: EngineReport) -> bool:
        """The engine's own load report (/metrics), read now. Returns whether it brought
        a new KV pool (the prefix index is resized to it unless the config sets one)."""
        return self._fleet.state.record_engine_report(backend, report, self.clock())

    def record_models(self, backend: str, served: ServedModels) -> bool:
        """What the backend's engine lists on /v1/models now. Returns whether that
        changed."""
        return self._fleet.state.set_discovered(backend, served)

    def record_scheduling(
        self, backend: str, scheduling: EngineScheduling | None, error: str = ""
    ) -> bool:
        """What the backend's engine says of its priority scheduling (/server_info; None:
        unreadable, `error` says why). Returns whether the router's writing changed."""
        b = self._fleet.state.backends.get(backend)
        if b is None:
            return False
        before = b.priority
        b.engine.scheduling, b.engine.scheduling_error = scheduling, error
        return b.priority.writes != before.writes or b.priority.lower_first != before.lower_first

    def served_by(self, request_id: str, backend: str) -> bool:
        """The data plane says another backend than the chosen one answers a request in
        flight (it went on to the next endpoint after a connect failure): its first byte
        and end are credited to that backend, its close counts a failover against the
        chosen one (Router.close). Returns whether that changed anything."""
        state = self._fleet.state
        if backend not in state.backends:
            return False
        return state.served_elsewhere(request_id, backend) is not None

    def stream_sample(self, request_id: str, chunk: bytes) -> None:
        """A chunk of a request's response stream that is one token's event (its second,
        or its first when it is also its last): its size counts the tokens at the end."""
        rec = self._fleet.state.in_flight.get(request_id)
        size = event_bytes(chunk)
        if rec is not None and size is not None and rec.token_event_bytes is None:
            rec.token_event_bytes = size

    def response_size(self, request_id: str, body_bytes: int) -> None:
        """A request's response body, whole, was this big: its generated tokens, counted
        from the size of its token events, teach the output lengths (a stream whose event
        size was not measured, or the simulator's known count, are left alone)."""
        rec = self._fleet.state.in_flight.get(request_id)
        if rec is None or rec.token_event_bytes is None or rec.generated_tokens is not None:
            return
        if body_bytes > 0:
            rec.generated_tokens = streamed_tokens(body_bytes, rec.token_event_bytes)

    def record_fallback(self, backend: str) -> None:
        self._fleet.state.record_fallback(backend)

    def set_token_check(self, backend: str, ok: bool, reason: str) -> None:
        """Whether the router's token ids are the backend's engine's; not ok keeps its
        prefix state approximate."""
        b = self._fleet.state.backends.get(backend)
        if b is not None:
            b.engine.tokens = TokenCheck(ok, reason)
