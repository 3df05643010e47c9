"""The price of a (prefill, decode) pair of engines in ms (docs/cost-model.md, "The pair's
price"): the trip to the prefill engine, its queue and prefill, the prompt's KV over the
link between the two engines' regions, the decode engine's wait and first step, the trip
back; the two knobs the model cannot know; and the online correction of the transfer."""

from __future__ import annotations

from dataclasses import dataclass

# Weight of one observed transfer in a link's learned factor (about the last 10), and the
# factor's bounds (an observation is a difference of two clocks' events: noisy).
TRANSFER_EWMA = 0.1
FACTOR_BOUNDS = (0.25, 8.0)


# The knobs' bounds when the tuner moves them (log space, so neither reaches 0): from
# where each stops mattering (16 tokens, llm-d's nonCachedTokens default; 1 ms) to where
# it forbids remote prefills outright (a 32k-token prompt; 10 s, over most TTFTs).
KNOB_BOUNDS = ((16.0, 32768.0), (1.0, 10_000.0))


@dataclass(frozen=True)
class PairKnobs:
    """What the model cannot know (the gorgo policy's parameters; with tuning on, the
    tuner's: learn.tuner with `pair_tuner_settings`): below `local_threshold_tokens`
    uncached tokens a prompt is prefilled in its decode engine's own region (or on an
    aggregated engine); a remote prefill must beat the best local one by
    `remote_margin_ms`."""

    local_threshold_tokens: int = 0
    remote_margin_ms: float = 0.0

    @staticmethod
    def of(values: tuple[float, float]) -> PairKnobs:
        """The knobs from the tuner's two values (threshold, margin)."""
        return PairKnobs(round(values[0]), values[1])

    def values(self) -> tuple[float, float]:
        return (float(self.local_threshold_tokens), self.remote_margin_ms)


@dataclass(frozen=True)
class PairPrice:
    """One pair's predicted TTFT, term by term (ms)."""

    prefill: str
    decode: str
    # The trip to the prefill engine, its wait and its prefill of the part not cached there.
    rtt_ms: float
    prefill_wait_ms: float
    prefill_ms: float
    # The KV moved (the prompt's tokens not cached on the decode engine) and its transfer.
    kv_bytes: int
    transfer_ms: float
    # The link's RTT (in transfer_ms).
    link_rtt_ms: float
    # The decode engine's wait for room, its first step, the first token's trip back.
    decode_wait_ms: float
    first_step_ms: float
    rtt_back_ms: float
    # The two engines are in different regions; the prompt's tokens not cached on the
    # prefill engine.
    remote: bool = False
    uncached_tokens: int = 0

    @property
    def total_ms(self) -> float:
        return (
            self.rtt_ms
            + self.prefill_wait_ms
            + self.prefill_ms
            + self.transfer_ms
            + self.decode_wait_ms
            + self.first_step_ms
            + self.rtt_back_ms
        )


def transfer_ms(kv_bytes: float, gbps: float, link_rtt_ms: float, factor: float = 1.0) -> float:
    """The KV's move over a link: its RTT plus bytes / bandwidth, the latter times the
    link's learned factor."""
    return link_rtt_ms + kv_bytes * 8 / (gbps * 1e9) * 1e3 * factor


def best_pair(prices: list[PairPrice], knobs: PairKnobs) -> PairPrice | None:
    """The pair to offer for one decode engine: the cheapest local one (prefill in the
    decode's region), unless a remote one beats it by the margin; a prompt with fewer
    uncached tokens than the threshold on a remote prefill engine is not sent there.
    None: no prefill engine at all."""
    local = min((p for p in prices if not p.remote), key=lambda p: p.total_ms, default=None)
    remote = min(
        (p for p in prices if p.remote and p.uncached_tokens >= knobs.local_threshold_tokens),
        key=lambda p: p.total_ms,
        default=None,
    )
    if remote is None:
        return local
    if local is None or remote.total_ms + knobs.remote_margin_ms < local.total_ms:
        return remote
    return local


class TransferFactors:
    """What the links' transfers really took against the bytes / bandwidth predicted, per
    pair of regions: an EWMA factor like the engines' speeds (1.0 until observed)."""

    def __init__(self) -> None:
        self._factor: dict[tuple[str, str], float] = {}

    @staticmethod
    def _key(a: str, b: str) -> tuple[str, str]:
        return (a, b) if a <= b else (b, a)

    def factor(self, a: str, b: str) -> float:
        return self._factor.get(self._key(a, b), 1.0)

    def observe(self, a: str, b: str, predicted_ms: float, observed_ms: float) -> None:
        """One transfer: its predicted bandwidth part (with the factor then) and what was
        observed for it."""
        if predicted_ms <= 0 or observed_ms <= 0:
            return
        key = self._key(a, b)
        old = self._factor.get(key, 1.0)
        ratio = min(max(observed_ms / predicted_ms * old, FACTOR_BOUNDS[0]), FACTOR_BOUNDS[1])
        self._factor[key] = old + TRANSFER_EWMA * (ratio - old)

    def as_json(self) -> dict[str, float]:
        return {f"{a}|{b}": round(f, 4) for (a, b), f in sorted(self._factor.items())}
