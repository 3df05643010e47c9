"""What `gorgo check` finds, as values: each problem with its fix, each thing the router
reads of a backend (precise or approximate, and why), a verdict per backend and per served
model, and the whole (judge.py builds it; report.py prints it).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Problem:
    """Something that will not work as configured: where (a backend, or the fleet), what,
    and the fix, naming the config key or the engine's flag to change."""

    where: str
    what: str
    fix: str

    def line(self) -> str:
        return f"{self.where}: {self.what}. Fix: {self.fix}"


@dataclass(frozen=True)
class Aspect:
    """One thing the router reads of a backend: precise (the engine's own) or approximate
    (the router's estimate), and from where or why."""

    precise: bool
    how: str


@dataclass
class BackendVerdict:
    """One backend as the router will see it."""

    id: str
    address: str
    engine: str
    reachable: bool
    rtt_ms: float | None
    models: list[str]
    prefix: Aspect
    tokens: Aspect
    queue: Aspect
    # Whether requests' priorities are written for its engine's scheduler ("precise":
    # written), and why.
    priority: Aspect


@dataclass
class ModelVerdict:
    """One served model: the backends that serve it, and on which of them each aspect is
    precise."""

    name: str
    backends: list[str]
    prefix_precise: list[str]
    tokens_exact: list[str]
    queue_from_engine: list[str]


@dataclass
class Verdict:
    """The whole check: the tokenizer, each backend and model, the problems (each one is
    an exit status 1) and the notes (approximations chosen by the config, no problem)."""

    tokenizer: str
    backends: list[BackendVerdict] = field(default_factory=list)
    models: list[ModelVerdict] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if self.problems else 0
