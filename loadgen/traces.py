"""Workload traces: readers, windows, a synthetic generator, and prompt synthesis.

A trace is a list of `TraceRequest`s sorted by arrival. Formats:
- Mooncake JSONL (FAST'25 release): `timestamp` (ms), `input_length`, `output_length`,
  `hash_ids` (512-token blocks; an id names a block together with its whole prefix).
- ART-Chat JSONL (the GORGO paper's dataset): `timestamp` (ms), an OpenAI chat body,
  `hash_ids` (hex strings, 256-token blocks), `token_hash` (a per-user id).
- Synthetic: seeded multi-turn sessions with adjustable prefix reuse and rate (tests);
  and `paper-synthetic[:SEED]`, a window shaped like the GORGO paper's (`paper_synthetic`;
  `workload_stats` measures any trace in the same terms).

Prompt synthesis turns block ids into text the project's tokenizer counts exactly (4 bytes
per token): every block id maps to its own deterministic text, so requests that share
leading ids share byte-identical prefixes.
"""

from __future__ import annotations

import json
import math
import random
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512
ART_BLOCK_TOKENS = 256


class TraceError(ValueError):
    """A trace file is unreadable; the message names the file and line."""


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    # Prefix block ids (each names its block and everything before it).
    block_ids: tuple[int, ...]
    block_tokens: int
    # The conversation this request belongs to (session affinity's key).
    session: str
    # ART-Chat rows carry the request body itself.
    body: dict[str, Any] | None = None
    # The model it asks for (the request's `model`; None: none named). Mooncake rows may
    # carry it as `model`; `two-models[:PATH]` assigns one per conversation.
    model: str | None = None

    @property
    def id(self) -> str:
        return f"t{self.index}"


def _rows(path: Path) -> Iterable[tuple[int, dict[str, Any]]]:
    try:
        f = path.open(encoding="utf-8")
    except OSError as e:
        raise TraceError(f"{path}: cannot read trace: {e.strerror}") from e
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{n}: not JSON: {e.msg}") from e
            if not isinstance(row, dict):
                raise TraceError(f"{path}:{n}: expected a JSON object per line")
            yield n, row


def _int(row: dict[str, Any], key: str, where: str) -> int:
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TraceError(f"{where}: {key!r} must be a non-negative integer, got {v!r}")
    return v


def read_mooncake(path: str | Path) -> list[TraceRequest]:
    p = Path(path)
    raw: list[tuple[int, int, int, tuple[int, ...], str | None]] = []
    for n, row in _rows(p):
        where = f"{p}:{n}"
        ids = row.get("hash_ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
        n_in = _int(row, "input_length", where)
        if len(ids) != math.ceil(n_in / MOONCAKE_BLOCK_TOKENS):
            raise TraceError(
                f"{where}: {len(ids)} hash_ids for {n_in} input tokens "
                f"(expected ceil({n_in}/{MOONCAKE_BLOCK_TOKENS}))"
            )
        model = row.get("model")
        if model is not None and (not isinstance(model, str) or not model.strip()):
            raise TraceError(f"{where}: 'model' must be a non-empty string, got {model!r}")
        out_len = _int(row, "output_length", where)
        raw.append((_int(row, "timestamp", where), n_in, out_len, tuple(ids), model))
    if not raw:
        raise TraceError(f"{p}: no requests")
    shared = _common_prefix_len([r[3] for r in raw])
    raw.sort(key=lambda r: r[0])  # stable: equal timestamps keep file order
    return [
        TraceRequest(
            i,
            ts / 1000.0,
            n_in,
            max(1, n_out),
            ids,
            MOONCAKE_BLOCK_TOKENS,
            # The conversation's root: its first block after the prefix every request
            # shares (a system prompt: block 0 in the conversation trace).
            f"s{ids[min(shared, len(ids) - 1)]}",
            model=model,
        )
        for i, (ts, n_in, n_out, ids, model) in enumerate(raw)
    ]


def read_art_chat(path: str | Path) -> list[TraceRequest]:
    p = Path(path)
    out: list[TraceRequest] = []
    hex_ids: dict[str, int] = {}
    for n, row in _rows(p):
        where = f"{p}:{n}"
        body = row.get("body", row.get("request"))
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise TraceError(f"{where}: expected an OpenAI chat body under 'body'")
        ids = row.get("hash_ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise TraceError(f"{where}: 'hash_ids' must be a list of hex strings")
        from ext_proc.prompt.tokens import count_tokens, render_chat

        n_in = count_tokens(render_chat(body["messages"]))
        n_out = body.get("max_tokens") or body.get("max_completion_tokens") or 256
        out.append(
            TraceRequest(
                len(out),
                _int(row, "timestamp", where) / 1000.0,
                n_in,
                int(n_out),
                tuple(hex_ids.setdefault(h, len(hex_ids)) for h in ids),
                ART_BLOCK_TOKENS,
                f"u{row.get('token_hash', '')}",
                body,
            )
        )
    out.sort(key=lambda r: r.arrival_s)
    return [replace(r, index=i) for i, r in enumerate(out)]


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Mooncake or ART-Chat, told apart by the first row."""
    p = Path(path)
    for _, row in _rows(p):
        return read_art_chat(p) if "body" in row or "request" in row else read_mooncake(p)
    raise TraceError(f"{p}: no requests")


# The trace source naming the paper-shaped synthetic window (`paper-synthetic:SEED` for
# another seed) wherever a trace file is expected.
PAPER_SYNTHETIC = "paper-synthetic"


def load_trace(source: str | Path) -> list[TraceRequest]:
    """A trace file (`read_trace`), or `paper-synthetic[:SEED]`: the paper-shaped window
    generated for that seed (0 by default), or `two-models[:PATH]`: a trace (the Mooncake
    conversation trace by default) with a model per conversation (loadgen.trace_models).
    A file of either name: `./paper-synthetic`."""
    name, _, seed = str(source).partition(":")
    if name == "two-models":
        from loadgen.trace_models import two_models

        return two_models(seed or None)
    if name == PAPER_SYNTHETIC:
        try:
            return paper_synthetic(int(seed or 0))
        except ValueError:
            raise TraceError(
                f"{source}: expected {PAPER_SYNTHETIC} or {PAPER_SYNTHETIC}:SEED (an integer)"
            ) from None
    return read_trace(source)


def write_mooncake(path: str | Path, trace: Iterable[TraceRequest]) -> Path:
    """Write a trace as Mooncake JSONL (arrivals rounded to whole milliseconds), e.g. a
    synthetic one for `gorgo replay`. Needs 512-token blocks, as the format defines."""
    p = Path(path)
    lines = []
    for r in trace:
        if r.block_tokens != MOONCAKE_BLOCK_TOKENS:
            raise ValueError(
                f"request {r.id}: {r.block_tokens}-token blocks; Mooncake rows use "
                f"{MOONCAKE_BLOCK_TOKENS}"
            )
        row: dict[str, Any] = {
            "timestamp": round(r.arrival_s * 1000),
            "input_length": r.input_tokens,
            "output_length": r.output_tokens,
            "hash_ids": list(r.block_ids),
        }
        if r.model is not None:
            row["model"] = r.model
        lines.append(json.dumps(row) + "\n")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(lines), encoding="utf-8")
    return p


def _common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    first = seqs[0]
    n = len(first)
    for s in seqs[1:]:
        n = min(n, len(s))
        while n and s[:n] != first[:n]:
            n -= 1
        if not n:
            break
    return n


def window(
    trace: Sequence[TraceRequest],
    start_s: float = 0.0,
    duration_s: float | None = None,
    limit: int | None = None,
) -> list[TraceRequest]:
    """Requests arriving in [start_s, start_s + duration_s) (trace time), at most limit,
    with arrivals shifted so the window starts at 0."""
    out = [
        r
        for r in trace
        if r.arrival_s >= start_s and (duration_s is None or r.arrival_s < start_s + duration_s)
    ]
    if limit is not None:
        out = out[:limit]
    return [replace(r, arrival_s=r.arrival_s - start_s) for r in out]


def spread_arrivals(trace: Sequence[TraceRequest], seconds: float) -> list[TraceRequest]:
    """Spread each request's arrival over [t, t + seconds), deterministically (a crc32 of
    its id), in arrival order. The Mooncake conversation trace stamps arrivals in 3 s
    steps, ~10 requests at the very same instant: replayed as is, several routers decide
    each burst blind to one another, however fast they share (0: unchanged)."""
    if seconds <= 0:
        return list(trace)
    spread = [
        replace(r, arrival_s=r.arrival_s + seconds * zlib.crc32(r.id.encode()) / 2**32)
        for r in trace
    ]
    return sorted(spread, key=lambda r: r.arrival_s)


def scaled(trace: Sequence[TraceRequest], time_scale: float) -> list[TraceRequest]:
    """Stretch arrivals by time_scale (2 = half the rate), as the paper's client did."""
    return [replace(r, arrival_s=r.arrival_s * time_scale) for r in trace]


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


# ---------------------------------------------------------------------------------------
# A workload shaped like the paper's windows, and the statistics that describe one.


@dataclass(frozen=True)
class Target:
    """One statistic of the GORGO paper's windows: the range it reports
    (low == high where it gives one value) and the tolerance a generated window must
    meet, as a share of the range's ends."""

    low: float
    high: float
    tolerance: float

    def holds(self, value: float) -> bool:
        return self.low * (1 - self.tolerance) <= value <= self.high * (1 + self.tolerance)

    def __str__(self) -> str:
        return f"{self.low:g}" if self.low == self.high else f"{self.low:g}-{self.high:g}"


# The GORGO paper's windows of ART-Chat-2.5M (30 minutes each). Its "turns per
# conversation" is read here as the turns of a conversation that has more than one (the
# one reading that fits 74 % multi-turn requests with 12.8-16.4 requests per user); its
# 0.3 % of reuse across users makes reuse within a user's session 99.7 %. Tolerances: 10 %
# on the input length statistics (the paper gives them as "about"), 5 % on the others,
# 2 % on the reuse shares.
PAPER_WINDOW: dict[str, Target] = {
    "users": Target(540, 606, 0.05),
    "requests_per_user": Target(12.8, 16.4, 0.05),
    "turns_per_conversation": Target(22, 30, 0.05),
    "multi_turn_share": Target(0.74, 0.74, 0.05),
    "input_p50": Target(5700, 5700, 0.10),
    "input_mean": Target(7000, 7000, 0.10),
    "input_p95": Target(20500, 20500, 0.10),
    "block_reuse": Target(0.78, 0.88, 0.02),
    "reuse_within_session": Target(0.997, 0.997, 0.02),
    "rate_rps": Target(4.0, 4.8, 0.05),
}


@dataclass(frozen=True)
class WorkloadStats:
    """What a trace looks like, in the paper's terms (`workload_stats` says how each is
    measured)."""

    requests: int
    duration_s: float
    rate_rps: float
    users: int
    requests_per_user: float
    multi_turn_share: float
    turns_per_conversation: float
    input_p50: float
    input_mean: float
    input_p95: float
    output_mean: float
    block_reuse: float
    reuse_within_session: float


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


def workload_stats(trace: Sequence[TraceRequest]) -> WorkloadStats:
    """The paper's window statistics of any trace, from its block ids and sessions alone:

    - users: distinct session keys (the Mooncake reader's is a conversation's first block
      after the prefix every request shares; the paper-shaped generator gives each user a
      leading block of its own, so there a session is a user);
    - a request is multi-turn when it extends an earlier one (every complete block of an
      earlier request, beyond the shared prefix, leads its prompt); chains of those are
      conversations, and turns per conversation is the mean length of those with two or
      more requests;
    - block reuse: the share of all blocks (hash ids) seen earlier in the trace (what an
      unbounded cache would hold); within session: the share of those first seen in the
      same session (the rest is reuse across users);
    - rate: requests per second from the first arrival to the last.
    """
    if not trace:
        raise ValueError("workload_stats: an empty trace")
    shared = _common_prefix_len([r.block_ids for r in trace])
    first_session: dict[int, str] = {}
    # The last complete block of each earlier request -> that request's conversation.
    conv_of_end: dict[int, int] = {}
    turns: list[int] = []
    multi = reused = within = blocks = 0
    for r in trace:
        conv = next(
            (conv_of_end[b] for b in reversed(r.block_ids[shared:]) if b in conv_of_end), None
        )
        if conv is None:
            conv = len(turns)
            turns.append(0)
        else:
            multi += 1
        turns[conv] += 1
        for b in r.block_ids:
            owner = first_session.get(b)
            if owner is None:
                first_session[b] = r.session
            else:
                reused += 1
                within += owner == r.session
        blocks += len(r.block_ids)
        full = r.input_tokens // r.block_tokens
        if full > shared:
            conv_of_end[r.block_ids[full - 1]] = conv
    inputs = np.array([r.input_tokens for r in trace], dtype=np.float64)
    span_s = trace[-1].arrival_s - trace[0].arrival_s
    users = len({r.session for r in trace})
    chains = [n for n in turns if n > 1]
    return WorkloadStats(
        requests=len(trace),
        duration_s=span_s,
        rate_rps=len(trace) / span_s if span_s > 0 else math.inf,
        users=users,
        requests_per_user=len(trace) / users,
        multi_turn_share=multi / len(trace),
        turns_per_conversation=sum(chains) / len(chains) if chains else 1.0,
        input_p50=float(np.percentile(inputs, 50)),
        input_mean=float(inputs.mean()),
        input_p95=float(np.percentile(inputs, 95)),
        output_mean=sum(r.output_tokens for r in trace) / len(trace),
        block_reuse=reused / blocks if blocks else 0.0,
        reuse_within_session=within / reused if reused else 1.0,
    )


# (label, how to show it) per statistic, in the order the paper gives them.
_STAT_ROWS = (
    ("users", "users", "{:.0f}"),
    ("requests_per_user", "requests per user", "{:.1f}"),
    ("turns_per_conversation", "turns per conversation (of those with 2+)", "{:.1f}"),
    ("multi_turn_share", "multi-turn requests", "{:.0%}"),
    ("input_p50", "input tokens p50", "{:,.0f}"),
    ("input_mean", "input tokens mean", "{:,.0f}"),
    ("input_p95", "input tokens p95", "{:,.0f}"),
    ("block_reuse", "block reuse", "{:.1%}"),
    ("reuse_within_session", "of which within the user's session", "{:.1%}"),
    ("rate_rps", "requests/s at time_scale 1", "{:.2f}"),
)


def _paper_cell(key: str, fmt: str) -> str:
    t = PAPER_WINDOW[key]
    lo, hi = fmt.format(t.low), fmt.format(t.high)
    return lo if lo == hi else f"{lo}-{hi}"


def stats_table(columns: Sequence[tuple[str, WorkloadStats]]) -> str:
    """A markdown table: the paper's windows, then one column per (label, stats)."""
    head = "| statistic | paper (its reported windows) | "
    head += " | ".join(c for c, _ in columns) + " |"
    lines = [head, "|---" * (2 + len(columns)) + "|"]
    for key, label, fmt in _STAT_ROWS:
        cells = [fmt.format(getattr(st, key)) for _, st in columns]
        lines.append(f"| {label} | {_paper_cell(key, fmt)} | " + " | ".join(cells) + " |")
    lines.append(
        "| requests (window length) | (30 min) | "
        + " | ".join(f"{st.requests:,} ({st.duration_s / 60:.0f} min)" for _, st in columns)
        + " |"
    )
    return "\n".join(lines)


def stats_line(st: WorkloadStats) -> str:
    """One line for a table's caption: what the workload looks like."""
    return (
        f"{st.users} users, {st.requests_per_user:.1f} requests each, "
        f"{st.multi_turn_share:.0%} multi-turn, input tokens p50/mean/p95 "
        f"{st.input_p50:,.0f}/{st.input_mean:,.0f}/{st.input_p95:,.0f}, block reuse "
        f"{st.block_reuse:.0%} ({st.reuse_within_session:.0%} within a session), "
        f"{st.rate_rps:.2f} requests/s"
    )


# ---------------------------------------------------------------------------------------
# Prompt synthesis.

# 3-letter words, each with a leading space: 4 bytes, one token under the project's
# approximation, and one token too under the tiny model's byte-level BPE (the emulated
# engines' default tokenizer, emulator/tokenizer.py): each " xyz" is one vocabulary entry,
# and its pre-tokenizer cuts text before every space + letters, so words never merge.
# tests/component/loadgen/test_prompt_tokens.py checks both counts.
_TINY_WORDS = (
    "ail aim ard ast bal ber bit bix bom bor bos bra bre bri bum bus bux byl byx cai cas "
    "cee cen cer ces cha che chi chy cil cim cin cir col com cus cut cyl cyr cyx dam dee "
    "del dim din dit dom don dos dot dou dun dyr eam eel een fat fax fea fen fet fit fou "
    "fox fun fur fus fut fyt gao gea gim gis gix gor gra gur gyr hax hee hex hin hir hoo "
    "hun hyx iom iox jam jar jex jil jou jum jut kam ket kol koo kot kum kyt ler lil lin "
    "lix lom los lul lum lyt mai mam mer mil mit mom mou mut mux mym myn nas nee nel nen "
    "nit non noo nun nut nyx ool oon oum oux pen pex pir pis ple poo pou pur pux pyl qua "
    "rax ret rix rur rux rys sas sat sax sea see sem ses shy sil sou sti stu sum sur sus "
    "sut syl tai tan tat tea ter thu til tit tol tos tra tri tro tur tyn tyx vat vax vee "
    "ver vio vor vum vur vut vux vyl vym vyt vyx wai wan was woo wor zex zin zio zir zou "
    "zut zyn zyx"
)
TINY_WORDS = _TINY_WORDS.split()
_WORDS = np.array([f" {w}" for w in TINY_WORDS], dtype="S4").view(np.uint32)
_N_WORDS = np.uint64(len(_WORDS))
_POSITIONS = np.arange(MOONCAKE_BLOCK_TOKENS, dtype=np.uint64)
# splitmix64 constants
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def block_text(block_id: int, tokens: int) -> str:
    """Deterministic text for one block: `tokens` words of a space and 3 letters (4 bytes,
    1 token each under the approximation and the tiny model's BPE alike: TINY_WORDS). Word
    j is a hash (splitmix64) of the block id and j alone, so fewer tokens give a prefix of
    the block's longer text (a partial last block matches the full block's start). ~18 us
    per 512-token block: the replay synthesizes prompts while it streams."""
    pos = _POSITIONS if tokens <= len(_POSITIONS) else np.arange(tokens, dtype=np.uint64)
    x = pos[:tokens] + np.uint64((block_id * _GOLDEN) & 0xFFFFFFFFFFFFFFFF)
    x ^= x >> _S30
    x *= _MIX1
    x ^= x >> _S27
    x *= _MIX2
    x ^= x >> _S31
    return _WORDS.take(x % _N_WORDS).tobytes().decode("ascii")


class PromptSynth:
    """Trace block ids -> prompt text, with a cache of recent blocks (prefixes repeat)."""

    def __init__(self, cache_blocks: int = 20_000) -> None:
        self._cache: dict[tuple[int, int], str] = {}
        self._cache_blocks = cache_blocks

    def _block(self, block_id: int, tokens: int) -> str:
        key = (block_id, tokens)
        text = self._cache.get(key)
        if text is None:
            if len(self._cache) >= self._cache_blocks:
                self._cache.pop(next(iter(self._cache)))
            text = self._cache[key] = block_text(block_id, tokens)
        return text

    def prompt(self, r: TraceRequest) -> str:
        """Exactly r.input_tokens tokens; the last block may be partial."""
        parts = []
        left = r.input_tokens
        for block_id in r.block_ids:
            n = min(r.block_tokens, left)
            if n <= 0:
                break
            parts.append(
                self._block(block_id, n) if n == r.block_tokens else block_text(block_id, n)
            )
            left -= n
        return "".join(parts)
