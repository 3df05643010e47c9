"""Fakes with behaviour, shared by the tests."""

from __future__ import annotations


class FakeClock:
    """A monotonic clock the test moves by hand (seconds)."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds
