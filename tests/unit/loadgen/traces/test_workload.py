"""The paper-shaped synthetic workload and the statistics that describe any trace."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from loadgen.traces.load import load_trace
from loadgen.traces.readers import read_trace, write_mooncake
from loadgen.traces.request import TraceError, TraceRequest
from loadgen.traces.stats import PAPER_WINDOW, stats_table, workload_stats
from loadgen.traces.synthetic import paper_synthetic, synthetic
from loadgen.traces.windows import window

ROOT = Path(__file__).resolve().parents[4]
# The conversation trace beside the checkout; a fresh clone has the bundled head of it.
CONVERSATION = ROOT.parent / "shared/traces/mooncake-fast25/conversation_trace.jsonl"
HEAD = ROOT / "loadgen/data/mooncake-conversation-head400.jsonl"


@pytest.fixture(scope="module")
def generated() -> list[TraceRequest]:
    return paper_synthetic(0)


def test_the_generated_window_is_within_tolerance_of_the_papers(
    generated: list[TraceRequest],
) -> None:
    conversation = (
        ("conversation trace, first 30 min", window(read_trace(CONVERSATION), 0, 1800))
        if CONVERSATION.exists()
        else ("conversation trace, first 400", read_trace(HEAD))
    )
    columns = [
        ("paper-synthetic (seed 0)", workload_stats(generated)),
        ("paper-synthetic (seed 1)", workload_stats(paper_synthetic(1))),
        (conversation[0], workload_stats(conversation[1])),
    ]
    print("\n" + stats_table(columns))
    for label, st in columns[:2]:
        misses = {
            k: (getattr(st, k), str(t))
            for k, t in PAPER_WINDOW.items()
            if not t.holds(getattr(st, k))
        }
        assert not misses, f"{label}: outside the tolerances: {misses}"
    # the conversation trace is what the paper's windows are not
    assert not PAPER_WINDOW["block_reuse"].holds(columns[2][1].block_reuse)


def test_deterministic_for_a_seed_and_named_as_a_trace_source(
    generated: list[TraceRequest],
) -> None:
    assert load_trace("paper-synthetic") == generated
    assert load_trace("paper-synthetic:3") == paper_synthetic(3) != generated
    with pytest.raises(TraceError, match="paper-synthetic:SEED"):
        load_trace("paper-synthetic:x")
    assert load_trace(HEAD) == read_trace(HEAD)


def test_a_user_chats_or_sends_single_turns_behind_a_prefix_of_its_own(
    generated: list[TraceRequest],
) -> None:
    by_user: dict[str, list[TraceRequest]] = {}
    for r in generated:
        assert len(r.block_ids) == -(-r.input_tokens // 512) and r.block_tokens == 512
        by_user.setdefault(r.session, []).append(r)
    chats = 0
    for rs in by_user.values():
        pairs = list(itertools.pairwise(rs))
        full = [a.input_tokens // 512 for a, _ in pairs]
        if all(b.block_ids[:n] == a.block_ids[:n] for (a, b), n in zip(pairs, full, strict=True)):
            chats += len(rs) > 1  # each turn carries the conversation so far, in whole blocks
            assert all(b.input_tokens > a.input_tokens + a.output_tokens for a, b in pairs)
        else:  # single turns: the user's prefix, then a prompt of their own
            lead = rs[0].block_ids[0]
            assert all(r.block_ids[0] == lead for r in rs)
            assert all(b.block_ids[1:] != a.block_ids[1:] for a, b in pairs)
    assert 0.4 < chats / len(by_user) < 0.5  # 248 of 573 chat: 74 % multi-turn requests
    arrivals = [r.arrival_s for r in generated]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0 and arrivals[-1] < 1800


def test_stats_round_trip_through_mooncake_rows(
    generated: list[TraceRequest], tmp_path: Path
) -> None:
    back = read_trace(write_mooncake(tmp_path / "w.jsonl", generated))
    a, b = workload_stats(generated), workload_stats(back)
    assert (a.users, a.multi_turn_share, a.block_reuse, a.input_p95) == (
        b.users,
        b.multi_turn_share,
        b.block_reuse,
        b.input_p95,
    )


def test_stats_of_a_known_trace() -> None:
    # 4 sessions x 3 turns, each turn its conversation so far: every turn after the first
    # extends the one before; the shared system prompt is left out of the sessions
    t = synthetic(sessions=4, turns=3, rate_rps=1.0, system_tokens=512, turn_tokens=512)
    st = workload_stats(t)
    assert (st.requests, st.users, st.requests_per_user) == (12, 4, 3.0)
    assert st.multi_turn_share == pytest.approx(8 / 12)
    assert st.turns_per_conversation == 3.0
    # blocks: 2 + 3 + 4 per session = 36; seen before: the system block 11 times and each
    # turn's history (1 + 2 per session)
    assert st.block_reuse == pytest.approx((11 + 4 * 3) / 36)
    # within: the histories, and the system block in its first session's later turns
    assert st.reuse_within_session == pytest.approx((12 + 2) / 23)
    assert st.input_p50 == 1536 and st.output_mean == 64
    with pytest.raises(ValueError, match="empty"):
        workload_stats([])
