"""Whether a backend's engine schedules by the request's `priority`, and in which order:
from SGLang's `GET /server_info` (pure), and the config's `backends[].priority_scheduling`.

The engines' facts (their source):
- SGLang (python/sglang/srt/server_args.py, entrypoints/http_server.py get_server_info):
  `/server_info` (and `/get_server_info`) returns the server args at its top level, among
  them `enable_priority_scheduling` (`--enable-priority-scheduling`) and
  `schedule_low_priority_values_first` (`--schedule-low-priority-values-first`): by
  default a HIGHER value is served first (managers/schedule_policy.py), with the flag a
  lower one. An SGLang older than priority scheduling reports neither: off.
- vLLM (vllm/v1/core/sched): under `--scheduling-policy priority` a LOWER value is served
  first (ties by arrival), and the running request of the largest (priority, arrival) is
  preempted when KV blocks run out; without it a non-zero `priority` is answered 400. It
  reports its policy nowhere a router reads, so only the config can turn it on.

The router's own objectives order the other way round from vLLM (`flow_control.objectives[].
priority`: higher is more important), so the value written is the objective's priority,
negated for an engine that serves lower values first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ext_proc.vocab.backend import Backend, EngineKind, PriorityScheduling

# The SGLang server args read (python/sglang/srt/server_args.py).
ENABLE_KEY = "enable_priority_scheduling"
LOW_FIRST_KEY = "schedule_low_priority_values_first"


class ServerInfoError(ValueError):
    """A /server_info answer the router cannot read (names what is wrong)."""


@dataclass(frozen=True)
class EngineScheduling:
    """What an SGLang engine says of its priority scheduling."""

    priority: bool
    low_values_first: bool = False


def parse_server_info(doc: Any) -> EngineScheduling:
    """A /server_info body (decoded JSON) as the engine's priority scheduling."""
    if not isinstance(doc, Mapping):
        raise ServerInfoError("expected a JSON object")
    enabled = doc.get(ENABLE_KEY, False)
    low_first = doc.get(LOW_FIRST_KEY, False)
    for key, value in ((ENABLE_KEY, enabled), (LOW_FIRST_KEY, low_first)):
        if not isinstance(value, bool):
            raise ServerInfoError(f"{key}: expected true or false, got {value!r}")
    return EngineScheduling(enabled, low_first)


@dataclass(frozen=True)
class PriorityWriting:
    """Whether the router writes a request's priority for one backend's engine, in which
    order the engine serves values, and why (for /state and the log)."""

    writes: bool
    lower_first: bool
    reason: str
    # What the engine takes a body without `priority` for (None: not a value; SGLang
    # serves such a request after every other under priority scheduling, scheduler.py
    # _set_or_validate_priority); vLLM's field defaults to 0 (openai protocol.py).
    absent_value: int | None = None

    def engine_value(self, priority: int) -> int:
        """The value for the engine of a request whose objective has `priority` (higher
        is more important): the same order as the objectives', in the engine's sign."""
        return -priority if self.lower_first else priority

    def to_write(self, priority: int, client: int | None) -> int | None:
        """The `priority` to write into a body that has `client` (None: none) for a
        request of `priority`; None: nothing to write (not written for this engine, or
        the body already says so)."""
        if not self.writes:
            return None
        value = self.engine_value(priority)
        said = self.absent_value if client is None else client
        return None if said == value else value

    def as_json(self) -> dict[str, Any]:
        return {
            "writes": self.writes,
            "order": ("lower_first" if self.lower_first else "higher_first")
            if self.writes
            else None,
            "reason": self.reason,
        }


def priority_writing(
    b: Backend, info: EngineScheduling | None, info_error: str = ""
) -> PriorityWriting:
    """For backend `b`, with what its engine's /server_info said (None: not read, or not
    readable: `info_error`)."""
    setting = b.priority_scheduling
    if setting is PriorityScheduling.OFF:
        return PriorityWriting(False, False, "backends[].priority_scheduling: off")
    if b.engine is EngineKind.VLLM:
        if setting is PriorityScheduling.ON:
            return PriorityWriting(
                True,
                True,
                "on: vLLM serves lower values first (--scheduling-policy priority)",
                absent_value=0,
            )
        return PriorityWriting(
            False,
            True,
            "auto: vLLM does not report its scheduling policy; set on if it runs "
            "--scheduling-policy priority",
        )
    if info is None:
        unread = f"/server_info not read ({info_error})" if info_error else "/server_info not read"
        if setting is PriorityScheduling.ON:
            return PriorityWriting(
                True, False, f"on: SGLang's default order (higher first); {unread}"
            )
        return PriorityWriting(False, False, f"auto: {unread} yet")
    order = "lower values first" if info.low_values_first else "higher values first"
    if setting is PriorityScheduling.ON:
        said = "" if info.priority else f"; its /server_info says {ENABLE_KEY} false"
        return PriorityWriting(True, info.low_values_first, f"on: SGLang serves {order}{said}")
    if not info.priority:
        return PriorityWriting(False, False, f"auto: /server_info says {ENABLE_KEY} false")
    return PriorityWriting(
        True, info.low_values_first, f"auto: /server_info says {ENABLE_KEY}, {order}"
    )
