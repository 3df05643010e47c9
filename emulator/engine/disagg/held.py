"""The prefill side's KV held for decodes, by bootstrap room (SGLang) or by request id
(vLLM): who waits for whom, what is sent, and what became of it.

SGLang (disaggregation/prefill.py, common/bootstrap.py): the prefill and the decode get
the same request at once, in either order. The prefill may not compute before the decode
has bootstrapped and sent its KV indices (PrefillBootstrapQueue.pop_bootstrapped), so an
entry is opened by whichever side comes first: the decode's pull marks `decode_arrived`,
the prefill offers its KV (`offer`) when its prefill is done, the pull sends it and
settles `sent`. A side that gives up leaves a tombstone (`failed`, kept `ttl_s`), so the
other side, early or late, fails at once instead of waiting for a room nobody will fill
(DeferredBootstrap: "a late endpoint must not wait forever").

vLLM (nixl/scheduler.py request_finished): the prefill holds its blocks after answering,
until a decode has read them or VLLM_NIXL_ABORT_REQUEST_TIMEOUT passes (then they are
freed and counted as expired: vllm:nixl_num_kv_expired_reqs).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field


class TransferAborted(Exception):
    """The transfer did not happen; `reason` says why (it ends up in the error message)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class KvOffer:
    """KV ready to send: its tokens, its size in the engine's bytes and on the wire, and
    the prefill's cached-token count (SGLang sends it with the KV)."""

    tokens: int
    engine_bytes: int
    wire_bytes: int
    cached_tokens: int


def _future() -> asyncio.Future[KvOffer]:
    return asyncio.get_running_loop().create_future()


def _done_future() -> asyncio.Future[None]:
    return asyncio.get_running_loop().create_future()


@dataclass
class Held:
    """One room's (or request's) KV and the two sides' meeting point."""

    key: str
    decode_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    offer: asyncio.Future[KvOffer] = field(default_factory=_future)
    sent: asyncio.Future[None] = field(default_factory=_done_future)
    failed: str | None = None
    # Called once when the entry goes (to free the KV reservation).
    on_drop: Callable[[], None] | None = None

    def give_up(self, reason: str) -> None:
        """This side failed: the other side learns it wherever it waits (a prefill still
        waiting for its decode wakes up to the failure)."""
        if self.failed is None:
            self.failed = reason
        self.decode_arrived.set()
        if not self.offer.done():
            self.offer.set_exception(TransferAborted(reason))
            self.offer.exception()  # retrieved: nobody may ever await it
        if not self.sent.done():
            self.sent.set_exception(TransferAborted(reason))
            self.sent.exception()


class HeldKv:
    """The table of held KV. Tombstones of failed entries expire after ttl_s."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.entries: dict[str, Held] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def open(self, key: str) -> Held:
        """The entry for key, made if new (by whichever side comes first)."""
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = Held(key)
        return entry

    def get(self, key: str) -> Held | None:
        return self.entries.get(key)

    def fail(self, key: str, reason: str) -> None:
        """Fail the entry (made if new) and keep its tombstone for ttl_s."""
        entry = self.open(key)
        entry.give_up(reason)
        self._release(entry)
        self.expire_in(key, self.ttl_s)

    def expire_in(
        self, key: str, seconds: float, on_expire: Callable[[], None] | None = None
    ) -> None:
        """Drop the entry after `seconds` (and call on_expire if it was still there)."""
        self._cancel_timer(key)

        def expire() -> None:
            self._timers.pop(key, None)
            if key in self.entries:
                if on_expire is not None:
                    on_expire()
                self.drop(key)

        self._timers[key] = asyncio.get_running_loop().call_later(seconds, expire)

    def drop(self, key: str) -> None:
        entry = self.entries.pop(key, None)
        self._cancel_timer(key)
        if entry is not None:
            self._release(entry)

    def close(self) -> None:
        """Fail and drop everything (the engine stops)."""
        for key in list(self.entries):
            self.entries[key].give_up("the prefill engine stopped")
            self.drop(key)

    def _release(self, entry: Held) -> None:
        drop, entry.on_drop = entry.on_drop, None
        if drop is not None:
            drop()

    def _cancel_timer(self, key: str) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            with contextlib.suppress(Exception):
                timer.cancel()
