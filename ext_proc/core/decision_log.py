"""The last N decisions, for /state and the operator's page (/ui): each with when it was
made, its trace id once a span recorded it, and once its request closed what came beside
what the chosen backend predicted. Bounded in memory; every operation on the request path
is O(1) (an append, a dict lookup)."""

from __future__ import annotations

from collections import deque
from typing import Any

from ext_proc.vocab.events import Closed, Listener
from ext_proc.vocab.types import Decision


class Entry:
    """One decision shown. `number` is the log's count when it was made (its key); `seq`
    grows each time the entry changes (made, then closed), so a poller asks for what
    changed since the last `seq` it saw."""

    __slots__ = ("at_s", "decision", "number", "observed", "seq", "trace_id")

    def __init__(self, decision: Decision, at_s: float, seq: int) -> None:
        self.decision = decision
        self.at_s = at_s
        self.number = self.seq = seq
        self.observed: dict[str, Any] | None = None
        self.trace_id: str | None = None

    def as_json(self) -> dict[str, Any]:
        chosen = self.decision.chosen
        return {
            **self.decision.as_json(),
            "predicted_ttft_ms": round(chosen.predicted_ttft_ms, 3),
            "predicted_e2e_ms": round(chosen.predicted_e2e_ms, 3),
            "observed": self.observed,
        }


class DecisionLog(Listener):
    """The last `size` decisions. An outcome is kept only with a decision still shown; a
    reused request id shows its newest decision's outcome."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a decision log holds at least 1 decision, got {size}")
        self.size = size
        self._shown: deque[Entry] = deque()
        self._by_id: dict[str, Entry] = {}
        self.seq = 0

    @property
    def decisions(self) -> tuple[Decision, ...]:
        return tuple(e.decision for e in self._shown)

    def __len__(self) -> int:
        return len(self._shown)

    def add(self, d: Decision, now_s: float) -> None:
        if len(self._shown) == self.size:
            old = self._shown.popleft()
            if self._by_id.get(old.decision.request_id) is old:
                del self._by_id[old.decision.request_id]
        self.seq += 1
        entry = Entry(d, now_s, self.seq)
        self._shown.append(entry)
        self._by_id[d.request_id] = entry

    def set_trace(self, request_id: str, trace_id: str) -> None:
        """The decision's span was recorded under this trace (the page links to it)."""
        e = self._by_id.get(request_id)
        if e is not None:
            e.trace_id = trace_id

    def on_close(self, e: Closed) -> None:
        entry = self._by_id.get(e.request_id)
        if entry is None or entry.observed is not None:
            return
        streamed = e.record.streaming and e.ttft_ms is not None
        entry.observed = {
            "status": str(e.status),
            # None: not a stream (its first byte is the whole answer), or no first byte.
            "ttft_ms": round(e.ttft_ms, 3) if streamed and e.ttft_ms is not None else None,
            "e2e_ms": round(e.e2e_ms, 3),
        }
        if e.record.prefill_backend is not None:  # the KV's transfer, as observed
            seen = e.record.observed_transfer_ms
            entry.observed["kv_transfer_ms"] = None if seen is None else round(seen, 3)
        self.seq += 1
        entry.seq = self.seq

    def find(self, request_id: str) -> Entry | None:
        return self._by_id.get(request_id)

    def changed_since(self, seq: int) -> list[Entry]:
        """Entries made or closed after `seq`, oldest decision first."""
        if seq >= self.seq:
            return []
        return [e for e in self._shown if e.seq > seq]

    def as_json(self, last: int) -> list[dict[str, Any]]:
        """The newest `last` decisions, oldest first (/state's recent_decisions)."""
        n = len(self._shown)
        return [self._shown[i].as_json() for i in range(max(0, n - last), n)]
