"""The admission seam (director.admission): a transport admits each request and takes the
waits settled from `pump`'s return, each once and in order; flow control off passes every
request straight through; nothing but the flow controller changes its queue."""

import ast
from pathlib import Path

from ext_proc.director.admission import PassThrough
from ext_proc.director.flow_control import FlowController
from ext_proc.director.outcomes import Queued, Routed, Settled
from ext_proc.director.recipe import Director
from ext_proc.feeds.peers import PeerEvent, PeerKind
from ext_proc.flow.queue import FlowQueue, QueueView
from tests.builders import chat, load, make_router

ROOT = Path(__file__).resolve().parents[3]
# Room for one request waiting for its first token at backend a, whatever its work.
ONE = {"enabled": True, "max_waiting_requests": 1, "room_margin_ms": 1e9}


def one_slot() -> Director:
    router, _ = make_router("gorgo", backends=["a"], flow_control=ONE)
    load(router, "peer", "a", 1000, 10)  # another router's request: no room
    return Director(router)


def room_comes(director: Director) -> None:
    director.router.inputs.apply_peer(PeerEvent(PeerKind.CLOSED, "x", "peer", "a"))


def test_pump_returns_the_waits_it_settled_each_once() -> None:
    director = one_slot()
    first, second = (director.handle(chat(rid=rid)) for rid in ("r1", "r2"))
    assert isinstance(first, Queued) and isinstance(second, Queued)
    assert director.admission.pump() == []  # no room yet: nothing settled
    room_comes(director)
    settled = director.admission.pump()
    assert [type(s) for s in settled] == [Settled]
    [(ticket, outcome)] = settled
    assert ticket is first.ticket and ticket.done and isinstance(outcome, Routed)
    assert director.admission.pump() == []  # handed out once; r2 waits for room
    assert not second.ticket.done and len(director.admission.queue) == 1


def test_a_wait_settled_by_another_requests_admission_comes_with_the_next_pump() -> None:
    director = one_slot()
    first = director.handle(chat(rid="r1"))
    assert isinstance(first, Queued)
    room_comes(director)
    # r2's admission offers the queue room: r1, first in order, takes it; r2 waits
    second = director.handle(chat(rid="r2"))
    assert isinstance(second, Queued) and "r1" in director.router.in_flight
    [(ticket, outcome)] = director.admission.pump()
    assert ticket is first.ticket and isinstance(outcome, Routed)
    assert director.admission.pump() == []


def test_flow_control_off_passes_every_request_straight_through() -> None:
    router, _ = make_router("gorgo", backends=["a"])
    load(router, "peer", "a", 1000, 10)
    director = Director(router)
    assert isinstance(director.admission, PassThrough)
    assert isinstance(director.handle(chat(rid="r1")), Routed)
    assert director.admission.pump() == []
    assert director.admission.snapshot() == {"enabled": False}
    assert director.admission.claims_to_send() is None
    assert director.admission.confirm(["r1"]) == 0


# What changes a FlowQueue: every public method its read-only view leaves out.
MUTATORS = {
    n for n in vars(FlowQueue) if not n.startswith("_") and callable(getattr(FlowQueue, n))
} - set(vars(QueueView))


def _queue_changes(tree: ast.AST) -> list[str]:
    """Calls of a queue's mutators through something named `queue` or `_queue`."""
    return [
        f"{node.lineno}: {ast.unparse(node.func)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in MUTATORS
        and ast.unparse(node.func.value).rpartition(".")[2] in ("queue", "_queue")
    ]


def test_nothing_but_the_flow_controller_changes_its_queue() -> None:
    assert {"push", "remove", "expired", "charge"} <= MUTATORS
    assert not hasattr(FlowController, "released")  # no list of outcomes to take or swap
    owner = ROOT / "ext_proc" / "director" / "flow_control.py"
    offenders = {
        str(p.relative_to(ROOT)): hits
        for root in ("ext_proc", "loadgen", "emulator", "tests")
        for p in sorted((ROOT / root).rglob("*.py"))
        if p != owner and (hits := _queue_changes(ast.parse(p.read_text(encoding="utf-8"))))
    }
    assert offenders == {}
    assert _queue_changes(ast.parse(owner.read_text(encoding="utf-8")))  # the check sees it
