"""When `gorgo up` restarts a child that died: the supervisor's policy, with no processes
in it (the clock is passed in), so backoff and crash-loop give-up are tested on their own.
emulator/stack/supervision.py (SupervisedChildren.tend) applies its decisions to the real children.

A child that exits is restarted after a backoff that doubles with each exit in a row
(0.5, 1, 2, 4, 8 s with the defaults); one that then runs `healthy_after_s` without
exiting starts the next backoff afresh. More than `max_restarts` restarts of one child
within `window_s` is a crash loop: the supervisor gives up on it, except on a router
(`persistent_suffixes`), which it keeps restarting every `backoff_max_s`: Envoy fails open
while it is down, so the front door serves on until its config is fixed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    # First restart after 0.5 s: long enough that a child failing at once does not spin
    # the CPU, short enough that a router crash costs about a second of fail-open routing
    # (Envoy keeps serving meanwhile) and an engine crash about as long as its probes take
    # to notice it anyway.
    backoff_s: float = 0.5
    # Doubling up to 8 s: a child that keeps failing is retried 5 times within ~16 s.
    backoff_max_s: float = 8.0
    # 5 restarts of one child within 60 s and the 6th exit is a crash loop: restarting
    # will not fix it (a bad config, a port someone else holds, a bug).
    max_restarts: int = 5
    window_s: float = 60.0
    # A child that ran 10 s had started fine (the stack's children are ready in 1-3 s; a
    # real vLLM in ~30 s, which then counts its exits as a streak, still bounded by the
    # crash-loop rule): its next exit waits backoff_s again.
    healthy_after_s: float = 10.0
    # Children whose name ends so are never given up on: past the crash-loop rule they are
    # restarted every backoff_max_s. The routers: while one is down Envoy fails open (the
    # fallback route), so the front door serves on, and giving up would stop the whole
    # stack, front door and engines, for a config file someone is about to fix.
    persistent_suffixes: tuple[str, ...] = ("gorgo-serve",)

    def persistent(self, name: str) -> bool:
        return name.endswith(self.persistent_suffixes) if self.persistent_suffixes else False

    def __post_init__(self) -> None:
        if not 0 < self.backoff_s <= self.backoff_max_s:
            raise ValueError("supervision: need 0 < backoff_s <= backoff_max_s")
        if self.max_restarts < 0 or self.window_s <= 0 or self.healthy_after_s < 0:
            raise ValueError("supervision: max_restarts >= 0, window_s > 0, healthy_after_s >= 0")


@dataclass(frozen=True)
class Restart:
    """Restart `name` at `at_s`: its `attempt`-th restart in a row, after `delay_s`.
    `crash_loop`: past the crash-loop rule (a child never given up on); `loop_began`: the
    first such restart of this streak (the one to tell the operator about)."""

    name: str
    attempt: int
    delay_s: float
    at_s: float
    crash_loop: bool = False
    loop_began: bool = False


@dataclass(frozen=True)
class GiveUp:
    """`name` exited again after `restarts` restarts within `window_s`: a crash loop."""

    name: str
    restarts: int
    window_s: float


@dataclass
class _Child:
    started_s: float
    streak: int = 0  # exits in a row, each within healthy_after_s of its start
    restarts_s: deque[float] = field(default_factory=deque)  # when restarts were scheduled
    looping: bool = False  # in a crash loop it is kept restarted through (told once)


class Supervisor:
    """Decides, per child, when to restart it and when to give up. Pure: the caller says
    when a child started or exited and asks which restarts are due."""

    def __init__(self, policy: RestartPolicy | None = None) -> None:
        self.policy = policy or RestartPolicy()
        self._children: dict[str, _Child] = {}
        self._pending: dict[str, Restart] = {}

    def started(self, name: str, now_s: float) -> None:
        """`name` was (re)started at now_s."""
        child = self._children.get(name)
        if child is None:
            self._children[name] = _Child(started_s=now_s)
        else:
            child.started_s = now_s
        self._pending.pop(name, None)

    def exited(self, name: str, now_s: float) -> Restart | GiveUp:
        """`name` was found exited at now_s: when to restart it, or give up on it."""
        p = self.policy
        child = self._children.setdefault(name, _Child(started_s=now_s))
        if now_s - child.started_s >= p.healthy_after_s:
            child.streak = 0
            child.looping = False
        while child.restarts_s and child.restarts_s[0] <= now_s - p.window_s:
            child.restarts_s.popleft()
        crash_loop = len(child.restarts_s) >= p.max_restarts
        if crash_loop and not p.persistent(name):
            self._pending.pop(name, None)
            return GiveUp(name, len(child.restarts_s), p.window_s)
        child.streak += 1
        delay_s = min(p.backoff_s * 2 ** (child.streak - 1), p.backoff_max_s)
        loop_began = crash_loop and not child.looping
        if crash_loop:
            delay_s = p.backoff_max_s
            child.looping = True
        child.restarts_s.append(now_s)
        restart = Restart(name, child.streak, delay_s, now_s + delay_s, crash_loop, loop_began)
        self._pending[name] = restart
        return restart

    def pending(self, name: str) -> bool:
        """A restart of `name` is scheduled and not yet done."""
        return name in self._pending

    def due(self, now_s: float) -> list[Restart]:
        """The scheduled restarts whose time has come (the caller restarts them and calls
        started())."""
        return sorted((r for r in self._pending.values() if r.at_s <= now_s), key=lambda r: r.at_s)

    def recovered(self, now_s: float) -> list[str]:
        """Children kept restarted through a crash loop that have now run healthy_after_s
        since their last start: out of it (each reported once)."""
        out = []
        for name, child in self._children.items():
            running_s = now_s - child.started_s
            if (
                child.looping
                and name not in self._pending
                and running_s >= self.policy.healthy_after_s
            ):
                child.looping = False
                out.append(name)
        return out

    def forget(self, name: str) -> None:
        """`name` was stopped on purpose: no restart, no history."""
        self._children.pop(name, None)
        self._pending.pop(name, None)


__all__ = ["GiveUp", "Restart", "RestartPolicy", "Supervisor"]
