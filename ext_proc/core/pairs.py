"""A disaggregated fleet's candidates: each decode engine offered with its best prefill
engine (estimate.transfer.best_pair), priced as one TTFT, or whole where it prefills the
prompt itself sooner (vLLM's: `prefills_itself`), beside the aggregated engines whole;
the policy then chooses among them as among any candidates (docs/cost-model.md, "The
pair's price"). A fleet without prefill or decode engines never comes here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ext_proc.config.schema import Routing
from ext_proc.core.backend import BackendState
from ext_proc.estimate.transfer import PairKnobs, PairPrice, TransferFactors, best_pair, transfer_ms
from ext_proc.vocab.backend import BackendRole, EngineKind
from ext_proc.vocab.policy import Choice, PairPick
from ext_proc.vocab.types import Candidate, InFlight, PrefillLeg

# The display-only term a pair's candidate carries (no weight: already in its prefill).
KV_TRANSFER = "kv_transfer_ms"


@dataclass(frozen=True)
class PairedCandidates:
    """What the policy chooses among (aggregated engines whole, decode engines each with
    its prefill partner's price folded in), and each decode engine's pair."""

    candidates: tuple[Candidate, ...]
    pairs: Mapping[str, PairPrice]
    # Each paired decode engine's prefill partner, as a candidate of its own.
    partners: Mapping[str, Candidate]
    # The decode engine a PairPolicy picked (its one candidate), else None: the policy
    # chooses among the candidates.
    picked: str | None = None
    # What a remote pair chosen must win by (PairKnobs.remote_margin_ms).
    margin_ms: float = 0.0

    def with_margin(self, choice: Choice) -> Choice:
        """A remote pair chosen must score `margin_ms` below every candidate prefilled in
        its decode's region or whole, else the best of those is taken instead."""
        margin_ms = self.margin_ms
        pair = self.pairs.get(choice.backend_id)
        if pair is None or not pair.remote or margin_ms <= 0:
            return choice
        scores = choice.scores
        local = [
            c.backend_id
            for c in self.candidates
            if c.backend_id in scores
            and not (c.backend_id in self.pairs and self.pairs[c.backend_id].remote)
        ]
        best = min(local, key=lambda b: scores[b], default=None)
        if best is None or scores[choice.backend_id] + margin_ms < scores[best]:
            return choice
        return Choice(best, scores)


def disaggregated(backends: Mapping[str, BackendState], candidates: Sequence[Candidate]) -> bool:
    """Whether any candidate is a prefill or a decode engine."""
    return any(backends[c.backend_id].config.role is not BackendRole.BOTH for c in candidates)


def legs(
    backends: Mapping[str, BackendState], candidates: Sequence[Candidate]
) -> tuple[list[Candidate], list[Candidate]]:
    """The decode engines and the prefill engines among the candidates (a PairPolicy's
    choice; aggregated engines are neither)."""
    role = {c.backend_id: backends[c.backend_id].config.role for c in candidates}
    decodes = [c for c in candidates if role[c.backend_id] is BackendRole.DECODE]
    prefills = [c for c in candidates if role[c.backend_id] is BackendRole.PREFILL]
    return decodes, prefills


def prefills_itself(b: BackendState) -> bool:
    """Whether a decode engine serves a request whole, prefill included: vLLM's does for a
    request without kv_transfer_params (the NIXL connector transfers nothing then:
    kv_connector/v1/nixl update_state_after_alloc; emulator/engine/disagg/nixl.py), while
    SGLang's decode mode takes only requests with a bootstrap room."""
    return b.config.engine is EngineKind.VLLM


def kv_bytes_per_token(b: BackendState, routing: Routing) -> int:
    """The model's KV per token: the config's when it says (the model served), else the
    engine profile's."""
    return routing.kv_bytes_per_token or b.profile.kv_bytes_per_token


def price(
    p: Candidate,
    d: Candidate,
    pb: BackendState,
    db: BackendState,
    routing: Routing,
    factors: TransferFactors,
    input_tokens: int,
) -> PairPrice:
    """The pair (p prefills, d decodes): p's trip, wait and prefill of what p lacks; the
    KV of what d lacks over their link; d's wait for room and first step; the trip back."""
    a, b = pb.config.region, db.config.region
    gbps, link_rtt_ms = routing.kv_link.link(a, b)
    kv_bytes = max(0, input_tokens - d.cached_tokens) * kv_bytes_per_token(db, routing)
    first_step_ms = (
        db.profile.decode_ms(db.load.in_flight + 1, input_tokens) * db.learned.speed.decode_factor
    )
    return PairPrice(
        prefill=p.backend_id,
        decode=d.backend_id,
        rtt_ms=p.rtt_ms,
        prefill_wait_ms=p.wait_ms,
        prefill_ms=p.prefill_ms,
        kv_bytes=kv_bytes,
        transfer_ms=transfer_ms(kv_bytes, gbps, link_rtt_ms, factors.factor(a, b)),
        link_rtt_ms=link_rtt_ms,
        decode_wait_ms=d.wait_ms,
        first_step_ms=first_step_ms,
        rtt_back_ms=d.rtt_ms,
        remote=a != b,
        uncached_tokens=p.uncached_tokens,
    )


def as_candidate(d: Candidate, p: Candidate, pair: PairPrice) -> Candidate:
    """The decode engine as a candidate with its pair's price: the trips, waits and
    prefill (the transfer and first step with it) replace its own; its decode, KV and
    other terms stay the decode side's (its E2E guard and decode terms)."""
    terms = dict(d.terms)
    terms.update(
        rtt=pair.rtt_ms + pair.rtt_back_ms,
        queue=d.queue_ms + pair.prefill_wait_ms,  # the decode's wait stays in its terms
        prefill=pair.prefill_ms + pair.transfer_ms + pair.first_step_ms,
    )
    if "decode_stall" in terms:  # the prompt's prefill stalls the prefill engine's decodes
        terms["decode_stall"] = p.term("decode_stall")
    terms[KV_TRANSFER] = pair.transfer_ms
    return replace(d, cached_tokens=p.cached_tokens, uncached_tokens=p.uncached_tokens, terms=terms)


def paired_candidates(
    candidates: Sequence[Candidate],
    backends: Mapping[str, BackendState],
    routing: Routing,
    knobs: PairKnobs,
    factors: TransferFactors,
    input_tokens: int,
) -> PairedCandidates:
    """The aggregated engines as they are, each decode engine with its best prefill
    partner; prefill engines are no candidates of their own."""
    by_role: dict[BackendRole, list[Candidate]] = {r: [] for r in BackendRole}
    for c in candidates:
        by_role[backends[c.backend_id].config.role].append(c)
    prefills = by_role[BackendRole.PREFILL]
    out = list(by_role[BackendRole.BOTH])
    pairs: dict[str, PairPrice] = {}
    partners: dict[str, Candidate] = {}
    for d in by_role[BackendRole.DECODE]:
        db = backends[d.backend_id]
        prices = [
            price(p, d, backends[p.backend_id], db, routing, factors, input_tokens)
            for p in prefills
        ]
        whole = prefills_itself(db)
        best = best_pair(prices, knobs)
        if best is None:  # no prefill engine: whole if it can be
            if whole:
                out.append(d)
            continue
        partner = next(p for p in prefills if p.backend_id == best.prefill)
        pair = as_candidate(d, partner, best)
        if whole and _whole_ms(d) <= _whole_ms(pair):
            out.append(d)  # it prefills the prompt itself, for less than the pair
            continue
        pairs[d.backend_id] = best
        partners[d.backend_id] = partner
        out.append(pair)
    if not out:  # no pair at all (no prefill engine healthy): the decode engines whole
        return PairedCandidates(tuple(candidates), {}, {})
    return PairedCandidates(tuple(out), pairs, partners, margin_ms=knobs.remote_margin_ms)


def picked_pair(
    candidates: Sequence[Candidate],
    backends: Mapping[str, BackendState],
    routing: Routing,
    factors: TransferFactors,
    input_tokens: int,
    pick: PairPick,
) -> PairedCandidates:
    """The pair a PairPolicy picked, priced as gorgo prices any pair (for its records and
    its span); without a prefill engine, the decode engine whole."""
    by_id = {c.backend_id: c for c in candidates}
    d = by_id.get(pick.decode)
    p = by_id.get(pick.prefill) if pick.prefill is not None else None
    if d is None or (pick.prefill is not None and p is None):
        raise ValueError(f"pair {pick} names a backend that is not a candidate")
    if p is None:
        return PairedCandidates((d,), {}, {}, d.backend_id)
    pair = price(
        p, d, backends[p.backend_id], backends[d.backend_id], routing, factors, input_tokens
    )
    return PairedCandidates(
        (as_candidate(d, p, pair),), {d.backend_id: pair}, {d.backend_id: p}, d.backend_id
    )


def _whole_ms(c: Candidate) -> float:
    """What a decode engine's candidate costs whole or paired: its TTFT, plus the stall its
    prefill there inflicts on the requests decoding there (none when paired: the prefill
    runs elsewhere), which is what taking prefill off the decode engines saves."""
    return c.predicted_ttft_ms + c.term("decode_stall")


def prefill_leg(pair: PairPrice) -> PrefillLeg:
    """The decision's prefill half (Decision.prefill)."""
    return PrefillLeg(pair.prefill, pair.kv_bytes, pair.transfer_ms)


def pair_leg(rec: InFlight, pair: PairPrice, paired: PairedCandidates) -> InFlight:
    """The prefill engine's record of a paired request (it loads that engine until the
    decode's first byte), and the decode's record set for the decode side: nothing to
    prefill there but its first step, the rest of the pair's time its wait."""
    p = paired.partners[pair.decode]
    rec.prefill_backend = pair.prefill
    rec.transfer_ms = pair.transfer_ms
    rec.transfer_bandwidth_ms = pair.transfer_ms - pair.link_rtt_ms
    rec.cached_tokens = rec.input_tokens  # its KV comes over the link
    rec.prefill_ms = pair.first_step_ms
    rec.queue_ms = pair.total_ms - pair.rtt_ms - pair.rtt_back_ms - pair.first_step_ms
    rec.replay_features = None  # the decode engine's replay priced a prefill it won't run
    rec.matched_last_used_s = None  # the decode engine's report says nothing of P's cache
    return InFlight(
        request_id=rec.request_id,
        backend=pair.prefill,
        dispatched_s=rec.dispatched_s,
        input_tokens=rec.input_tokens,
        output_tokens=1,
        cached_tokens=p.cached_tokens,
        prefill_ms=p.prefill_ms,
        rtt_ms=p.rtt_ms,
        queue_ms=p.wait_ms,
        expected_output_tokens=1.0,
        model=rec.model,
        priority=rec.priority,
        envoy=rec.envoy,
        # the prefill engine's replay of its queue and prefill (what its end teaches)
        replay_features=p.replay_features,
        replay_credit_ms=p.replay_credit_ms,
    )
