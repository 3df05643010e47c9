"""How far an engine's KV-event stream can be trusted (`StreamHealth`): whether the router
has the engine's whole history (warm), the stores it could not place under a parent, and
whether the stream is one the router can use at all.

Warm: vLLM publishes a block once, when it is first cached
(vllm/v1/core/block_pool.py cache_full_blocks), so what an engine cached before the router
subscribed is never heard of. A stream whose first batch on every DP rank is seq 0 (the
engine's first events, or a replay that reached back to them) has it all; any other is
warming until its predictions prove out: `WARM_AGREEMENTS` completed requests in a row
whose prediction, had it been precise, was within one block of what the engine reported.
A request where both are 0 says nothing either way and does not count. A router that hears
no reports (the live service: the usage block never reaches it) has a second sign: a
request that reuses a block the router never heard of stores its new blocks under that
unknown parent, so `QUIET_STORES` stores over `UNKNOWN_RECENT_S` of the engine's time
without one mean the blind spot no longer touches the traffic. An engine that has
published nothing since the router subscribed is taken as fresh: its first batch decides.

Unsupported (`unsupported`): streams the index can key nothing of, told by their shape
after `UNSUPPORTED_MIN_STORES` stores, each with what to do about it.

Pure: every time comes from the caller (the engine's batch stamps, wall seconds).
"""

from __future__ import annotations

from collections import deque

from ext_proc.feeds.kv_events import BlockStored

# Completed requests in a row that must agree before a warming stream is trusted: one
# could agree by chance (a prompt nobody sent before), three in a row rarely do.
WARM_AGREEMENTS = 3
# Warming predictions awaiting their request's outcome, at most (oldest dropped): far
# more than one backend has in flight.
EXPECTED_MAX = 4096
# "Recent" unknown parents: those of the last minute (a warm-up's show in seconds).
UNKNOWN_RECENT_S = 60.0
# Stores without an unknown parent, over at least UNKNOWN_RECENT_S, that end warming.
QUIET_STORES = 64
# Stores seen before a stream's shape is judged (a few requests' worth).
UNSUPPORTED_MIN_STORES = 64
# Share of stores that must look so (a real stream shows the opposite within a request).
_NEARLY_ALL = 0.95
_HALF = 0.5
_FEW = 0.05

# SGLang published each page's hash alone with no parent until its events were chained
# (sgl-project/sglang PR #13488, November 2025: the v0.5.6 release); before June 2025 (PR
# #6824) one event per radix node, of the node's length.
NO_PARENTS = "no parent hashes: pages arrive unchained (SGLang before v0.5.6?): upgrade"
REUSED_HASHES = (
    "an engine hash re-stored under another parent: page hashes are not chained "
    "(SGLang before v0.5.6?): upgrade"
)
SIZES_VARY = (
    "block sizes vary within a KV cache group: whole radix nodes, not pages "
    "(SGLang before mid-2025?): upgrade"
)


class StreamHealth:
    """How far one engine's KV-event stream can be trusted (its EngineBlocks' `health`):
    whether the router has the engine's whole history, the stores it could not place,
    and whether the stream's shape is one it can use (see the module's docstring)."""

    def __init__(self) -> None:
        self.stores = 0
        self._rootless_single = 0
        self._reused = 0
        self._odd_sizes = 0
        # Stores whose parent the router never heard of (their blocks are dropped).
        self.unknown_parents = 0
        self.unknown_parent_blocks = 0
        self._unknown_at: deque[float] = deque()
        # Per DP rank: its first batch since it was last forgotten was seq 0.
        self._from_start: dict[int, bool] = {}
        self.warmed = False
        self.agreements = 0
        self._expected: dict[str, int] = {}
        # Since when (engine time) and over how many stores no parent was unknown.
        self._quiet_since: float | None = None
        self._quiet_stores = 0

    # -- warm-up --------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        """The router has the engine's whole history (see the module's docstring)."""
        return self.warmed or all(self._from_start.values())

    def first_batch(self, rank: int, seq: int) -> None:
        self._from_start[rank] = seq == 0
        if seq != 0:
            self._unwarm()

    def _unwarm(self) -> None:
        self.warmed = False
        self.agreements = 0
        self._quiet_since, self._quiet_stores = None, 0

    def forget(self, rank: int | None = None) -> None:
        """The rank's (None: every rank's) state was reset: its next batch decides again,
        and the shape of the stream is judged afresh (a restart may be an upgrade)."""
        if rank is None:
            self._from_start.clear()
        else:
            self._from_start.pop(rank, None)
        self._unwarm()
        self.stores = self._rootless_single = self._reused = self._odd_sizes = 0

    def expect(self, request_id: str, tokens: int) -> None:
        """While warming: what a precise prediction said for a request sent here."""
        self._expected[request_id] = tokens
        if len(self._expected) > EXPECTED_MAX:
            del self._expected[next(iter(self._expected))]

    def settle(self, request_id: str, reported_tokens: int | None, tolerance_tokens: int) -> None:
        """The request closed: the engine reported its cached tokens (None: not known)."""
        expected = self._expected.pop(request_id, None)
        if expected is None or reported_tokens is None or self.warmed:
            return
        if abs(expected - reported_tokens) > tolerance_tokens:
            self.agreements = 0
        elif max(expected, reported_tokens) > 0:
            self.agreements += 1
            self.warmed = self.agreements >= WARM_AGREEMENTS

    # -- what the stores showed -------------------------------------------------------

    def stored(self, e: BlockStored, ts: float, reused: int = 0, odd_size: bool = False) -> None:
        if self._quiet_since is None:
            self._quiet_since = ts
        self._quiet_stores += 1
        if (
            self._quiet_stores >= QUIET_STORES
            and ts - self._quiet_since >= UNKNOWN_RECENT_S
            and not self.warmed
        ):
            self.warmed = True
        self.stores += 1
        self._rootless_single += e.parent_block_hash is None and len(e.block_hashes) == 1
        self._reused += reused > 0
        self._odd_sizes += odd_size

    def unknown_parent(self, ts: float, blocks: int) -> None:
        self._quiet_since, self._quiet_stores = ts, 0
        self.unknown_parents += 1
        self.unknown_parent_blocks += blocks
        self._unknown_at.append(ts)
        while self._unknown_at[0] < ts - UNKNOWN_RECENT_S:
            self._unknown_at.popleft()

    def recent_unknown_parents(self, now_ts: float) -> int:
        """Unknown parents in the last UNKNOWN_RECENT_S before now_ts (engine wall clock)."""
        return sum(1 for ts in self._unknown_at if ts >= now_ts - UNKNOWN_RECENT_S)

    @property
    def unsupported(self) -> str | None:
        """Why the stream cannot serve predictions (None: it can)."""
        n = self.stores
        if n < UNSUPPORTED_MIN_STORES:
            return None
        if self._rootless_single >= _NEARLY_ALL * n:
            return NO_PARENTS
        if self._reused >= _FEW * n:
            return REUSED_HASHES
        if self._odd_sizes >= _HALF * n:
            return SIZES_VARY
        return None
