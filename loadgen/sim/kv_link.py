"""Prefill and decode apart in the simulator (settings.pd): where each request's prefill
leg runs, and its KV's move to its decode engine over the link between their regions.

Each direction between two regions is one wire (a region to itself too): a transfer leaves
when the wire has sent the ones before it, takes its bytes / the link's bandwidth
(kv_link_gbps between regions, local_kv_link_gbps within one), and arrives the
link's RTT later (region_rtt_ms; paid once a transfer, as the router prices it:
estimate/transfer.py). The bytes are the prompt's tokens times the decode engine's
profile's KV bytes per token: the decode engine keeps no prefix of its own (SGLang's
decode side takes the whole prompt's KV, disaggregation/decode.py). It then starts the
request as its engine does (emulator/engine/disagg/prebuilt.py: SGLang emits the first
token the prefill sent at once; vLLM computes the last prompt token again).

The trips, as each protocol makes them through the router: SGLang's proxy sends both legs
at once, so the KV leaves at the prefill's end (the decode request is there by then);
vLLM's is two steps (emulator/engine/disagg/nixl.py): the prefill's answer goes back to
the router, which then sends the decode request, and only then does the decode engine
pull the KV, a half trip from P to the door and one from the door to D later."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from emulator.engine.disagg.prebuilt import PrebuiltModel
from emulator.engine.model.scheduler import EngineModel
from emulator.wan import region_rtt_ms
from loadgen.traces.request import TraceRequest


@dataclass
class KvStats:
    """What the links carried: the prefills sent apart, those to another region, and each
    transfer's time from the prefill's end to the KV's arrival (ms)."""

    prefills: int = 0
    remote: int = 0
    transfer_ms: list[float] = field(default_factory=list)
    remote_transfer_ms: list[float] = field(default_factory=list)

    def as_json(self) -> dict[str, float]:
        return {
            "prefills_apart": self.prefills,
            "remote_prefills": self.remote,
            "remote_share": round(self.remote / self.prefills, 4) if self.prefills else 0.0,
            "transfer_ms_p50": _median(self.transfer_ms),
            "remote_transfer_ms_p50": _median(self.remote_transfer_ms),
        }


def _median(values: list[float]) -> float:
    return round(sorted(values)[len(values) // 2], 2) if values else 0.0


class KvMover:
    """The prefill legs in flight and their KV on the wires between regions."""

    def __init__(
        self,
        engines: Mapping[str, EngineModel],
        regions: Mapping[str, str],
        kv_bytes_per_token: Mapping[str, int],
        gbps: Callable[[str, str], float],
        first_token_known: bool,
    ) -> None:
        self._engines = engines
        self._regions = regions
        self._kv_bytes_per_token = kv_bytes_per_token
        self._gbps = gbps
        self._first_token_known = first_token_known
        # The request's prefill engine while its prefill leg runs or its KV moves.
        self.prefill_of: dict[str, str] = {}
        self._decode_of: dict[str, tuple[str, TraceRequest]] = {}
        self._cached: dict[str, int] = {}
        self._relay_s: dict[str, float] = {}
        # When each wire (from region, to region) has sent all it was given.
        self._wire_free_s: dict[tuple[str, str], float] = {}
        self.stats = KvStats()
        # The requests sent apart (their ids), for what reads the run afterwards.
        self.sent: set[str] = set()

    def send(self, r: TraceRequest, prefill: str, decode: str, relay_s: float = 0.0) -> None:
        """The router sent r's prefill leg to `prefill`, its decode to `decode`; `relay_s`:
        the trips between the prefill's end and the transfer's start (vLLM's two steps)."""
        self.prefill_of[r.id] = prefill
        self._decode_of[r.id] = (decode, r)
        self._relay_s[r.id] = relay_s
        self.sent.add(r.id)
        self.stats.prefills += 1
        self.stats.remote += self._regions[prefill] != self._regions[decode]

    def prefilled(self, rid: str, cached_tokens: int, now_s: float) -> float:
        """The prefill leg's first token: its KV leaves on the wire. Returns when it
        arrives at the decode engine."""
        a, (decode, r) = self._regions[self.prefill_of[rid]], self._decode_of[rid]
        b = self._regions[decode]
        nbytes = r.input_tokens * self._kv_bytes_per_token[decode]
        start_s = max(now_s + self._relay_s.pop(rid), self._wire_free_s.get((a, b), 0.0))
        self._wire_free_s[(a, b)] = start_s + nbytes * 8 / (self._gbps(a, b) * 1e9)
        arrive_s = self._wire_free_s[(a, b)] + region_rtt_ms(a, b) / 1000
        self._cached[rid] = cached_tokens
        self.stats.transfer_ms.append((arrive_s - now_s) * 1000)
        if a != b:
            self.stats.remote_transfer_ms.append(self.stats.transfer_ms[-1])
        return arrive_s

    def arrived(self, rid: str, now_s: float) -> str:
        """The KV is at the decode engine: the request starts there. Returns that engine."""
        del self.prefill_of[rid]
        decode, r = self._decode_of.pop(rid)
        engine = self._engines[decode]
        assert isinstance(engine, PrebuiltModel), decode
        cached = self._cached.pop(rid)
        engine.submit_prebuilt(
            rid, r.input_tokens, r.output_tokens, now_s, cached, self._first_token_known
        )
        return decode
