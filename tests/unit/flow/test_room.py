"""When a backend has room (flow.room.has_room): its work not yet started below its one-way
delay plus the margin, and under the caps on requests and tokens waiting there."""

import pytest

from ext_proc.config.flow import FlowControl
from ext_proc.flow.room import Mix, has_room, within_caps
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


def test_one_class_alone_cannot_gain_two_within_the_window_can() -> None:
    mix = Mix(window_s=60.0)
    assert not mix.mixed(0.0)  # nothing seen
    mix.seen((0, "", "", 0.0), 0.0)
    mix.seen((0, "", "", 0.0), 10.0)  # the same class again: still one
    assert not mix.mixed(10.0)
    mix.seen((10, "", "interactive", 0.0), 20.0)
    assert mix.mixed(20.0) and mix.mixed(69.9)  # the first class last seen at 10 s
    assert not mix.mixed(70.0)  # 60 s after it: the interactive class alone again
    mix.seen((0, "light", "", 0.0), 75.0)  # another tenant is another class
    assert mix.mixed(75.0) and not mix.mixed(135.0)


def test_classes_gone_quiet_are_forgotten_past_64() -> None:
    mix = Mix(window_s=60.0)
    for i in range(65):
        mix.seen((0, f"t{i}", "", 0.0), float(i))  # t0..t4 are 60 s old at 64 s
    assert len(mix._last_s) == 60 and mix.mixed(64.0)


@pytest.mark.parametrize(
    ("kw", "settings", "within"),
    [
        ({"unstarted_ms": 60_000.0}, {}, True),  # the work test is not a cap
        ({"waiting_first_byte": 2}, {"max_waiting_requests": 2}, False),
        ({"waiting_tokens": 8000}, {"max_waiting_tokens": 8000}, False),
        ({"waiting_tokens": 7999}, {"max_waiting_tokens": 8000}, True),
    ],
)
def test_within_caps(kw: dict[str, float], settings: dict[str, float], within: bool) -> None:
    c = candidate("a", in_flight=0, waiting_first_byte=int(kw.pop("waiting_first_byte", 0)), **kw)
    assert within_caps(c, FlowControl(enabled=True, **settings)) is within  # type: ignore[arg-type]
