"""The gateway queue's async shell (envoy.holding.Holding): a request released before its
session waits for it (the session still sending Envoy the held reply's timer) gets its
outcome when it does wait, rather than hanging dispatched and never sent on."""

import asyncio

from ext_proc.core.pipeline import Director, Queued, Routed
from ext_proc.envoy.holding import Holding
from ext_proc.feeds.peers import PeerEvent, PeerKind
from tests.builders import chat, load, make_router


async def test_an_outcome_decided_before_its_session_waits_is_kept_for_it() -> None:
    router, _ = make_router(
        "gorgo",
        backends=["a"],
        flow_control={"enabled": True, "max_waiting_requests": 1, "room_margin_ms": 1e9},
    )
    director = Director(router)
    holding = Holding(director)
    load(router, "peer", "a", 1000, 10)  # another router's request: no room
    queued = director.handle(chat(rid="r1"))
    assert isinstance(queued, Queued)
    router.inputs.apply_peer(PeerEvent(PeerKind.CLOSED, "x", "peer", "a"))  # room comes ...
    director.pump()
    holding.deliver()  # ... and a pump decides it while its session is elsewhere
    assert "r1" in router.in_flight  # dispatched: its session must still hear of it
    out = await asyncio.wait_for(holding.wait(queued.ticket), 5)  # hung before the fix
    assert isinstance(out, Routed) and out.decision.request_id == "r1"
