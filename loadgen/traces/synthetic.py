"""Generated traces: seeded multi-turn sessions with adjustable prefix reuse and rate
(`synthetic`, for tests), and `paper-synthetic[:SEED]`, a window shaped like the GORGO
paper's (`paper_synthetic`; loadgen.traces.stats measures any trace in the same terms and
holds the generator to the paper's figures). Both in 512-token blocks (Mooncake rows).
"""

from __future__ import annotations

import math
import random
from statistics import NormalDist

from loadgen.traces.request import MOONCAKE_BLOCK_TOKENS, TraceRequest


def synthetic(
    sessions: int = 20,
    turns: int = 4,
    rate_rps: float = 2.0,
    reuse: float = 1.0,
    system_tokens: int = 1024,
    turn_tokens: int = 600,
    output_tokens: int = 64,
    seed: int = 0,
) -> list[TraceRequest]:
    """Multi-turn chat sessions: every request starts with a shared system prompt, and
    each turn carries its conversation so far (with probability `reuse`; otherwise the
    conversation restarts). Poisson arrivals at rate_rps, turns in order per session."""
    rng = random.Random(seed)
    bt = MOONCAKE_BLOCK_TOKENS
    next_id = 0

    def new_ids(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    system = new_ids(math.ceil(system_tokens / bt))
    arrivals: list[tuple[float, int, int]] = []
    t = 0.0
    for turn in range(turns):
        for s in range(sessions):
            t += rng.expovariate(rate_rps)
            arrivals.append((t, s, turn))
    history: dict[int, list[int]] = {}
    out: list[TraceRequest] = []
    for t, s, _ in sorted(arrivals):
        keep = history.get(s, system) if rng.random() < reuse else system
        ids = keep + new_ids(math.ceil(turn_tokens / bt))
        history[s] = ids
        out.append(TraceRequest(len(out), t, len(ids) * bt, output_tokens, tuple(ids), bt, f"s{s}"))
    return out


def paper_synthetic(
    seed: int = 0,
    *,
    duration_s: float = 1800.0,
    users: int = 573,
    requests_per_user: float = 14.6,
    turns: float = 26.0,
    multi_turn_share: float = 0.74,
    turns_sigma: float = 0.4,
    prefix_tokens: float = 2000.0,
    message_tokens: float = 88.0,
    answer_tokens: float = 170.0,
    scale_sigma: float = 0.2,
    heavy_share: float = 0.19,
    heavy_factor: float = 3.0,
    document_tokens: float = 1200.0,
    document_sigma: float = 0.8,
    min_gap_s: float = 10.0,
) -> list[TraceRequest]:
    """A window shaped like the GORGO paper's (PAPER_WINDOW), deterministic
    for a seed, in 512-token blocks (Mooncake rows: `write_mooncake` writes it).

    Defaults: the middle of the paper's ranges (573 users x 14.6 requests in 30 minutes:
    4.65 requests/s; conversations of 26 turns; 74 % multi-turn); the token sizes are
    fitted to its input lengths and block reuse (the statistics test holds them there).
    Every user has a prompt prefix of its own (a system prompt or custom instructions,
    lognormal around `prefix_tokens`, at least one whole block: it is the user's session
    key). Then either
    - a chat: one conversation of ~`turns` turns (lognormal, spread by `turns_sigma`),
      each prompt the whole conversation so far (prefix, then each turn's message and
      the answer, `output_tokens`, of the turn before) plus the new message; the sizes of
      a conversation's messages and answers scale together (lognormal `scale_sigma`, and
      `heavy_share` of the conversations `heavy_factor` times larger: pasted context, the
      long tail of input lengths). A conversation's complete blocks keep their ids from
      turn to turn; the last, partial block is new each time, as a hash of its tokens is;
    - or single turns: requests of their own (the prefix, then a document of lognormal
      size), as many as keep the share of multi-turn requests at `multi_turn_share`.
    No prefix is shared across users (the paper saw 0.3 % of its reuse across users).
    A user's requests fall uniformly over the window, at least `min_gap_s` apart (a chat
    user reads the answer before the next turn).
    """
    rng = random.Random(seed)
    bt = MOONCAKE_BLOCK_TOKENS
    total = users * requests_per_user
    chats = min(users, round(multi_turn_share * total / (turns - 1)))
    single_mean = max(1.0, (total - chats * turns) / max(1, users - chats))
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    def lognormal(median: float, sigma: float) -> float:
        return median * math.exp(rng.gauss(0.0, sigma))

    def spread(n: int, sigma: float) -> list[float]:
        """n lognormal factors at evenly spaced quantiles, shuffled: a window's mix of
        conversations varies little from seed to seed."""
        zs = [NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]
        rng.shuffle(zs)
        return [math.exp(sigma * z) for z in zs]

    def times(n: int) -> list[float]:
        gap_s = min(min_gap_s, duration_s / 2 / max(1, n - 1))
        starts = sorted(rng.uniform(0, duration_s - (n - 1) * gap_s) for _ in range(n))
        return [t + i * gap_s for i, t in enumerate(starts)]

    def answer(scale: float) -> int:
        return int(min(2000, max(16, lognormal(answer_tokens * scale, 0.5))))

    heavy = round(heavy_share * chats)
    scales = [
        x * (heavy_factor if i < heavy else 1.0) for i, x in enumerate(spread(chats, scale_sigma))
    ]
    lengths = [
        max(2, round(turns / math.exp(turns_sigma**2 / 2) * x)) for x in spread(chats, turns_sigma)
    ]
    rows: list[tuple[float, int, int, int, list[int]]] = []
    for user in range(users):
        prefix = int(min(6000, max(bt + 64, lognormal(prefix_tokens, 0.5))))
        prefix_ids = fresh(prefix // bt)
        if user < chats:
            scale = scales[user]
            blocks = list(prefix_ids)  # the conversation's complete blocks so far
            history = prefix
            for t in times(lengths[user]):
                n_in = history + int(max(8, lognormal(message_tokens * scale, 0.7)))
                n_out = answer(scale)
                blocks += fresh(n_in // bt - len(blocks))
                rows.append(
                    (t, user, n_in, n_out, blocks[: n_in // bt] + fresh(int(n_in % bt > 0)))
                )
                history = n_in + n_out
        else:
            for t in times(max(1, round(rng.gammavariate(2.0, single_mean / 2.0)))):
                n_in = prefix + int(max(bt, lognormal(document_tokens, document_sigma)))
                rows.append(
                    (
                        t,
                        user,
                        n_in,
                        answer(1.0),
                        prefix_ids + fresh(-(-n_in // bt) - len(prefix_ids)),
                    )
                )
    rows.sort(key=lambda row: row[0])
    return [
        TraceRequest(i, t, n_in, n_out, tuple(ids), bt, f"u{user}")
        for i, (t, user, n_in, n_out, ids) in enumerate(rows)
    ]
