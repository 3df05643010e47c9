"""What a trace looks like in the GORGO paper's terms: the paper's windows (`PAPER_WINDOW`,
each statistic with its tolerance), `workload_stats` of any trace, and the tables and
caption lines that show them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loadgen.traces.request import TraceRequest, common_prefix_len


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
    shared = common_prefix_len([r.block_ids for r in trace])
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
