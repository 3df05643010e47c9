"""When a backend has room (flow.room.has_room): its work not yet started below its one-way
delay plus the margin, and under the caps on requests and tokens waiting there."""

import pytest

from ext_proc.config.flow import FlowControl
from ext_proc.flow.room import has_room
from tests.builders import candidate


@pytest.mark.parametrize(
    ("case", "kw", "settings", "room"),
    [
        ("idle", {}, {}, True),
        # one-way 50 ms + margin 250 ms = 300 ms of work may wait there
        ("300 ms waiting 100 ms away", {"unstarted_ms": 300.0, "rtt_ms": 100.0}, {}, True),
        ("301 ms waiting 100 ms away", {"unstarted_ms": 301.0, "rtt_ms": 100.0}, {}, False),
        ("a far backend takes more", {"unstarted_ms": 400.0, "rtt_ms": 300.0}, {}, True),
        ("a wider margin", {"unstarted_ms": 1000.0}, {"room_margin_ms": 1000.0}, True),
        (
            "at the cap on waiting requests",
            {"waiting_first_byte": 2},
            {"max_waiting_requests": 2},
            False,
        ),
        ("under the cap", {"waiting_first_byte": 1}, {"max_waiting_requests": 2}, True),
        (
            "at the cap on waiting tokens",
            {"waiting_tokens": 8000},
            {"max_waiting_tokens": 8000},
            False,
        ),
        ("under it", {"waiting_tokens": 7999}, {"max_waiting_tokens": 8000}, True),
    ],
)
def test_room(case: str, kw: dict[str, float], settings: dict[str, float], room: bool) -> None:
    c = candidate("a", in_flight=0, waiting_first_byte=int(kw.pop("waiting_first_byte", 0)), **kw)
    assert has_room(c, FlowControl(enabled=True, **settings)) is room, case  # type: ignore[arg-type]
