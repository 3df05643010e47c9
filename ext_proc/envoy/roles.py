"""Which session a stream gets, from its first message (Envoy AI Gateway's
processorForPath + passThroughProcessor pattern), and the sessions that do not route:
pass-through and the fleet's model list.
"""

from __future__ import annotations

import json

from ext_proc.common.names import HEADER_REQUEST_ID
from ext_proc.core.router import Router
from ext_proc.director.recipe import Director
from ext_proc.envoy import codec
from ext_proc.envoy.access_log import Forward
from ext_proc.envoy.duplex import StreamedPassThroughSession, StreamedRoutingSession
from ext_proc.envoy.encoders import DecisionEncoder
from ext_proc.envoy.session_base import ObservingSession, Reply, Session
from ext_proc.envoy.sessions import RoutingSession
from ext_proc.prompt.engine_tokens import PromptTokenizer
from ext_proc.prompt.parse import api_for_path, route_path

# The OpenAI API's model list, answered by the router for the whole fleet.
MODELS_PATH = "/v1/models"


class PassThroughSession(Session):
    """Not an LLM call (or no request id): Envoy's fallback route serves it; nothing to
    decide or observe, so the stream ends after the first reply."""

    def handle(self, p: codec.Phase) -> Reply:
        self.done = True
        return self._reply(p.name)


class ModelsSession(Session):
    """`GET /v1/models` at the front door: the fleet's models (every name some backend
    serves), answered here in OpenAI's list shape (a backend whose models are not known
    adds none); while no backend's models are known, the fallback route takes it to an
    engine as before."""

    def __init__(self, router: Router, info: codec.StreamInfo) -> None:
        super().__init__(info)
        self.router = router

    def handle(self, p: codec.Phase) -> Reply:
        self.done = True
        models = self.router.served_models()
        if models is None:
            return self._reply(p.name)
        data = [
            {"id": name, "object": "model", "owned_by": "gorgo", "parent": parent}
            for name, parent in models.items()
        ]
        body = json.dumps({"object": "list", "data": data}).encode()
        return codec.immediate_response(200, body, {"content-type": "application/json"})


def open_session(
    router: Router,
    encoder: DecisionEncoder,
    first: codec.ProcessingRequest,
    phase: codec.Phase,
    trace_context: tuple[tuple[str, str], ...] = (),
    tokens: PromptTokenizer | None = None,
    forward: Forward | None = None,
    envoy: str = "",
    director: Director | None = None,
) -> Session:
    """The session for a stream, from its first message (`phase`, decoded) (Envoy AI
    Gateway's processorForPath + passThroughProcessor pattern)."""
    info = codec.stream_info(first)
    if info.observe_only:
        return ObservingSession(
            router,
            info,
            codec.request_id_attribute(first),
            forward,
            codec.response_status_attributes(first),
        )
    headers = phase.headers
    if (
        phase.name == codec.REQUEST_HEADERS
        and headers.get(":method") == "GET"
        and route_path(headers.get(":path", "")) == MODELS_PATH
        # a streamed stream must send back what it gets: answered here, or passed on
        and (not info.request_streamed or router.served_models() is not None)
    ):
        return ModelsSession(router, info)
    if (
        phase.name == codec.REQUEST_HEADERS
        and api_for_path(headers.get(":path", "")) is not None
        and headers.get(HEADER_REQUEST_ID)
    ):
        director = director if director is not None else Director(router)
        kind = StreamedRoutingSession if info.request_streamed else RoutingSession
        return kind(director, encoder, info, trace_context, tokens, envoy)
    if info.request_streamed:
        return StreamedPassThroughSession(router, encoder, info)
    return PassThroughSession(info)
