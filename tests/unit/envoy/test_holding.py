"""The gateway queue's async shell (envoy.holding.Holding): a request's future is held
from the moment it is queued, so a pump that settles it while its session is elsewhere
(still sending Envoy the held reply's timer) finds it, rather than leaving it dispatched
and never sent on; a stream gone before it waited takes its request out of the queue."""

import asyncio

from ext_proc.core.router import Router
from ext_proc.director.outcomes import Queued, Routed
from ext_proc.director.recipe import Director
from ext_proc.envoy.holding import Holding
from ext_proc.feeds.peers import PeerEvent, PeerKind
from tests.builders import chat, load, make_router

FLOW = {"enabled": True, "max_waiting_requests": 1, "room_margin_ms": 1e9}


def queued_r1(subscribed: bool = False) -> tuple[Router, Director, Holding, Queued]:
    """A one-backend router with flow control, its Director and the server's Holding
    (hearing the router's events if `subscribed`); another router's request leaves no
    room, so the request r1 is queued."""
    router, _ = make_router("gorgo", backends=["a"], flow_control=FLOW)
    director = Director(router)
    holding = Holding(director.admission, router.clock)
    if subscribed:
        router.subscribe(holding)
    load(router, "peer", "a", 1000, 10)  # another router's request: no room
    queued = director.handle(chat(rid="r1"))
    assert isinstance(queued, Queued)
    return router, director, holding, queued


async def test_an_outcome_decided_before_its_session_waits_is_kept_for_it() -> None:
    router, _, holding, queued = queued_r1(subscribed=True)
    with holding.hold(queued.ticket) as settled:  # as the server holds it, at once
        router.inputs.apply_peer(PeerEvent(PeerKind.CLOSED, "x", "peer", "a"))  # room comes ...
        for _ in range(3):
            await asyncio.sleep(0)  # ... and the pump decides it while its session is elsewhere
        assert "r1" in router.in_flight  # dispatched: its session must still hear of it
        out = await asyncio.wait_for(settled, 5)  # hung before the fix
    assert isinstance(out, Routed) and out.decision.request_id == "r1"
    await holding.stop()


async def test_a_stream_gone_before_its_request_is_settled_takes_it_out_of_the_queue() -> None:
    router, director, holding, queued = queued_r1()
    with holding.hold(queued.ticket):
        assert holding.held == 1
    # left unsettled (the server's generator closed while it sent the timer reply)
    assert holding.held == 0 and queued.ticket.done
    assert director.admission.snapshot()["outcomes"] == {"cancelled": 1}
    await holding.stop()
    assert director.admission.pump() == [] and "r1" not in router.in_flight


async def test_a_stream_cancelled_while_it_awaits_takes_its_request_out_of_the_queue() -> None:
    router, director, holding, queued = queued_r1()

    async def held() -> None:
        with holding.hold(queued.ticket) as settled:
            await settled  # as the server's stream task awaits it

    task = asyncio.create_task(held())
    await asyncio.sleep(0)
    task.cancel()  # gRPC cancels the stream's task: the awaited future is cancelled too
    await asyncio.gather(task, return_exceptions=True)
    assert queued.ticket.done and holding.held == 0
    assert director.admission.snapshot()["outcomes"] == {"cancelled": 1}
    router.inputs.apply_peer(PeerEvent(PeerKind.CLOSED, "x", "peer", "a"))  # room comes
    assert director.admission.pump() == [] and "r1" not in router.in_flight
    await holding.stop()
