"""The tuner's `paired` mode (learn/paired.py): parent and child on interleaved traffic,
a bootstrap's verdict per round, the E2E guard, confirmation, early ends, ties, freezing
and drift."""

import json
import random
from dataclasses import replace

import pytest

from ext_proc.config.schema import TunerArmKey
from ext_proc.learn.paired import PairedRounds
from ext_proc.learn.settings import CHILD, PARENT, TunerSettings
from ext_proc.learn.tuner import Tuner
from ext_proc.vocab.types import Weights
from loadgen.bench.tuner.study import false_accept_rate
from tests.unit.learn.arms import PAIRED_S, TIES, feed, next_step, route, tuner

# -- which arm serves a request --------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "arm_key", "request_id", "session_key", "arm"),
    [
        # the parity of crc32 of the request id: 1 the child, 0 the parent
        ("request r3 (crc32 odd)", TunerArmKey.REQUEST, "r3", "alice", CHILD),
        ("request r4 (crc32 even)", TunerArmKey.REQUEST, "r4", "dave", PARENT),
        # with the session key: the parity of crc32("arm:" + key), whatever the request
        ("session alice (even)", TunerArmKey.SESSION, "r3", "alice", PARENT),
        ("session dave (odd)", TunerArmKey.SESSION, "r4", "dave", CHILD),
        ("no session: the request id", TunerArmKey.SESSION, "r3", None, CHILD),
    ],
)
def test_the_arm_is_a_hash_of_the_request_or_its_session(
    case: str, arm_key: TunerArmKey, request_id: str, session_key: str | None, arm: str
) -> None:
    rounds = PairedRounds(tuner(replace(PAIRED_S, arm_key=arm_key)))
    assert rounds.arm_for(request_id, session_key) == arm, case


def test_frozen_weights_serve_everything() -> None:
    t = tuner()
    t.state.frozen = True
    rounds = PairedRounds(t)
    assert {rounds.arm_for(f"r{i}", None) for i in range(8)} == {PARENT}
    # nothing is compared while frozen: decisions alike never make a tie
    assert all(rounds.decided(True) is None for _ in range(2 * PAIRED_S.tie_decisions))
    assert t.state.history == [] and t.state.frozen


# -- a round's verdict -----------------------------------------------------------------


def play(rounds: PairedRounds, arm: str, ttfts: list[float], e2e_ms: float = 5000.0) -> list:  # type: ignore[type-arg]
    """Completions of one arm; the steps they ended."""
    return [step for ttft in ttfts if (step := rounds.observe(arm, ttft, e2e_ms)) is not None]


@pytest.mark.parametrize(
    ("case", "child_e2e_ms", "accepted"),
    [
        ("E2E as good", 5000.0, True),
        ("E2E 4 % worse: within the 5 % guard", 5200.0, True),
        ("E2E 6 % worse: the guard rejects it", 5300.0, False),
    ],
)
def test_a_round_of_arm_size_each_is_judged_on_p95_ttft_under_the_e2e_guard(
    case: str, child_e2e_ms: float, accepted: bool
) -> None:
    t = tuner(replace(PAIRED_S, confirm_rounds=1))
    parent, child = t.state.parent, t.state.child
    rounds = PairedRounds(t)
    # the parent's p95 of seven 1,000s and a 2,000: 1,000 + 0.65 x 1,000; the child's 500
    assert play(rounds, PARENT, [1000.0] * 7 + [2000.0]) == []
    assert play(rounds, CHILD, [500.0] * 7, child_e2e_ms) == []  # 7 of 8: not yet
    assert rounds.arm_sizes() == {PARENT: 8, CHILD: 7}
    (step,) = play(rounds, CHILD, [500.0], child_e2e_ms)
    assert (step.parent_p95_ms, step.child_p95_ms) == (pytest.approx(1650.0), 500.0)
    assert step.accepted is accepted, case
    assert step.note.startswith("P(child better) 1.00")
    assert ("E2E guard" in step.note) is not accepted
    assert t.state.parent == (child if accepted else parent)
    assert t.state.earned_p95_ms == (500.0 if accepted else pytest.approx(1650.0))
    assert rounds.arm_sizes() == {PARENT: 0, CHILD: 0}  # the next round starts empty


def test_a_child_no_better_is_rejected_and_the_parent_keeps_what_it_earned() -> None:
    t = tuner(replace(PAIRED_S, confirm_rounds=1))
    parent = t.state.parent
    rounds = PairedRounds(t)
    play(rounds, PARENT, [1000.0] * 8)
    (step,) = play(rounds, CHILD, [1000.0] * 8)  # equal: P(child better) 0
    assert not step.accepted and step.note.startswith("P(child better) 0.00")
    assert t.state.parent == parent and t.state.earned_p95_ms == 1000.0


# -- frozen weights and drift ----------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "p95_ms", "frozen"),
    [
        ("as good as earned", 1000.0, True),
        ("1.5 x what it earned: not beyond the drift", 1500.0, True),
        ("1.6 x: drift, exploring again", 1600.0, False),
    ],
)
def test_frozen_weights_watch_their_p95_over_two_arm_sizes(
    case: str, p95_ms: float, frozen: bool
) -> None:
    t = tuner()
    t.state.frozen, t.state.earned_p95_ms, t.state.sigma = True, 1000.0, 0.05
    rounds = PairedRounds(t)
    assert play(rounds, PARENT, [p95_ms] * 15) == []  # 2 x arm_size (8) = 16 needed
    steps = play(rounds, PARENT, [p95_ms])
    assert t.state.frozen is frozen, case
    if not frozen:
        (step,) = steps
        assert step.note == "drift: exploring again" and step.parent_p95_ms == 1600.0
        assert t.state.sigma == PAIRED_S.sigma0 and t.state.child != t.state.parent
    else:
        assert steps == [] and rounds.arm_sizes()[PARENT] == 0  # a fresh watch


# -- the tuner climbs, and rejects what is not better ----------------------------------


def test_paired_accepts_a_clearly_better_child_and_moves_towards_it() -> None:
    # TTFT falls as w_queue rises (up to the bound): the tuner should climb w_queue
    rng = random.Random(1)
    t = Tuner(replace(PAIRED_S, arm_size=16), Weights(1.0, 0.1), random.Random(3))
    feed(t, lambda w, arm: 1000 / w.queue * rng.uniform(0.9, 1.1), 1200)
    assert t.state.parent[1] > 0.5
    assert any(h["accepted"] for h in t.state.history)


def test_paired_rejects_noise_and_respects_the_e2e_guard() -> None:
    rng = random.Random(2)
    # pure noise: no child is better; the 80 % bootstrap confidence lets few through
    t = Tuner(PAIRED_S, Weights(1.0, 1.0), random.Random(4))
    feed(t, lambda w, arm: rng.uniform(100, 1000), 800)
    steps = t.state.history
    assert len(steps) >= 40 and sum(h["accepted"] for h in steps) <= 0.3 * len(steps)
    # a child with better TTFT but much worse E2E is rejected
    g = Tuner(PAIRED_S, Weights(1.0, 1.0), random.Random(5))
    feed(
        g,
        lambda w, arm: 500 if arm == CHILD else 1000,
        200,
        e2e_for=lambda w, arm: 20_000 if arm == CHILD else 10_000,
    )
    assert not any(h["accepted"] for h in g.state.history)
    assert all("E2E guard" in h["note"] for h in g.state.history)


def test_a_winning_child_is_accepted_only_when_it_wins_again() -> None:
    t = Tuner(PAIRED_S, Weights(1.0, 1.0), random.Random(0))
    child = t.state.child
    wins = lambda w, arm: 500.0 if arm == CHILD else 1000.0  # noqa: E731
    loses = lambda w, arm: 1000.0 if arm == CHILD else 500.0  # noqa: E731
    i = next_step(t, wins, 0)
    (first,) = t.state.history
    assert first["confirming"] and not first["accepted"] and "to confirm" in first["note"]
    assert t.state.parent == (1.0, 1.0) and t.state.child == child  # the same child again
    i = next_step(t, loses, i)
    assert t.state.parent == (1.0, 1.0) and not t.state.history[-1]["accepted"]
    assert t.state.wins == 0 and t.state.child != child  # a new child, from no wins
    child = t.state.child
    i = next_step(t, wins, next_step(t, wins, i))
    assert t.state.parent == child and t.state.history[-1]["accepted"]


def test_a_round_that_is_already_sure_ends_early() -> None:
    s = replace(PAIRED_S, arm_size=24)
    rng = random.Random(1)
    t = Tuner(s, Weights(1.0, 1.0), random.Random(0))
    # the child's TTFTs are a tenth of the parent's: sure at 12 per arm, twice
    feed(t, lambda w, arm: rng.uniform(90, 110) * (1 if arm == CHILD else 10), 200)
    accepted = [h for h in t.state.history if h["accepted"]]
    assert accepted and all("decided at 12 per arm" in h["note"] for h in accepted)
    # noise is rarely sure at 12: its rounds run to arm_size
    n = Tuner(s, Weights(1.0, 1.0), random.Random(2))
    feed(n, lambda w, arm: rng.uniform(900, 1100), 400)
    assert n.state.history and sum("decided at" in h["note"] for h in n.state.history) <= 2


def test_confirmation_cuts_false_accepts_on_noise() -> None:
    rng = random.Random(7)
    pool = [(rng.lognormvariate(7, 0.8), 0.0) for _ in range(2000)]
    pool = [(t, t * 4) for t, _ in pool]
    one = false_accept_rate(pool, replace(TunerSettings(), confirm_rounds=1), rounds=400)
    two = false_accept_rate(pool, TunerSettings(), rounds=400)
    assert one > 0.08 and two < 0.05 and two < one / 3


def test_the_tail_score_also_climbs_and_also_rejects_a_worse_e2e() -> None:
    s = replace(PAIRED_S, arm_size=16, score="tail")
    rng = random.Random(1)
    t = Tuner(s, Weights(1.0, 0.1), random.Random(3))
    feed(t, lambda w, arm: 1000 / w.queue * rng.uniform(0.9, 1.1), 1200)
    assert t.state.parent[1] > 0.5
    g = Tuner(s, Weights(1.0, 1.0), random.Random(5))
    feed(
        g,
        lambda w, arm: 500 if arm == CHILD else 1000,
        200,
        e2e_for=lambda w, arm: 20_000 if arm == CHILD else 10_000,
    )
    assert not any(h["accepted"] for h in g.state.history)
    json.dumps(g.state.history)  # plain values: the state file can hold them


def test_freezes_when_nothing_better_turns_up_and_resumes_on_drift() -> None:
    s = replace(PAIRED_S, sigma0=0.05, freeze_after=3)
    t = Tuner(s, Weights(1.0, 1.0), random.Random(0))
    feed(t, lambda w, arm: 1000.0 if arm == PARENT else 2000.0, 200)
    assert t.state.frozen and t.arm_for("any") == PARENT
    assert t.state.history[-1]["note"].endswith("; frozen")  # /state and the plot say so
    feed(t, lambda w, arm: 4000.0, 32, start=1000)  # p95 doubles: drift
    assert not t.state.frozen and t.state.sigma == s.sigma0


def test_session_arm_key_keeps_a_conversation_in_one_arm() -> None:
    from ext_proc.config.schema import TunerArmKey

    by_session = Tuner(
        replace(PAIRED_S, arm_key=TunerArmKey.SESSION), Weights(1, 1), random.Random(0)
    )
    by_request = Tuner(PAIRED_S, Weights(1, 1), random.Random(0))
    assert TunerSettings().arm_key == TunerArmKey.REQUEST  # the default is unchanged
    sessions = [f"s{k}" for k in range(40)]
    for s in sessions:
        turns = [f"{s}-turn{i}" for i in range(12)]
        assert len({by_session.arm_for(rid, s) for rid in turns}) == 1
        assert len({by_request.arm_for(rid, s) for rid in turns}) == 2
        assert by_session.weights_for(turns[0], s) == Weights(
            *(
                by_session.state.child
                if by_session.arm_for(turns[0], s) == CHILD
                else by_session.state.parent
            )
        )
    # Both arms still get sessions; a request without a session falls back to its id.
    assert {by_session.arm_for("x", s) for s in sessions} == {PARENT, CHILD}
    ids = [f"r{i}" for i in range(40)]
    assert [by_session.arm_for(r, None) for r in ids] == [by_request.arm_for(r) for r in ids]


def test_a_child_that_decides_alike_ties_widens_sigma_and_is_no_failure() -> None:
    t = Tuner(TIES, Weights(1.0, 1.0), random.Random(0))
    child, sigma = t.state.child, t.state.sigma
    for i in range(TIES.tie_decisions - 1):
        route(t, f"r{i}", alike=True)
    assert not t.state.history  # not yet
    route(t, "last", alike=True)
    (step,) = t.state.history
    assert step["tie"] and not step["accepted"] and "decided alike" in step["note"]
    assert t.state.sigma == pytest.approx(sigma / TIES.factor)  # wider, not narrower
    assert t.state.outcomes == [] and t.state.child != child  # no verdict; a new child
    assert t.steps_tied == 1 and t.steps_rejected == 0


def test_a_round_with_few_differing_decisions_is_a_tie_not_a_failure() -> None:
    t = Tuner(TIES, Weights(1.0, 1.0), random.Random(0))
    sigma = t.state.sigma
    i = 0
    while not t.state.history:  # 1 decision in 20 differs: below tie_share (0.1)
        rid = f"r{i}"
        route(t, rid, alike=i % 20 != 0)
        t.observe(rid, 1000.0 if t.arm_for(rid) == CHILD else 500.0, 5000.0)
        i += 1
    (step,) = t.state.history
    assert step["tie"] and t.state.outcomes == [] and t.state.sigma > sigma
    # the same round with most decisions different is judged: the worse child rejected
    u = Tuner(TIES, Weights(1.0, 1.0), random.Random(0))
    i = 0
    while not u.state.history:
        rid = f"r{i}"
        route(u, rid, alike=i % 2 == 0)
        u.observe(rid, 1000.0 if u.arm_for(rid) == CHILD else 500.0, 5000.0)
        i += 1
    (step,) = u.state.history
    assert not step["tie"] and u.state.outcomes == [False]


def test_a_salted_tuner_splits_the_same_traffic_independently() -> None:
    """Two tuners on one request stream (the weights' and the P/D knobs'): with a salt, each
    one's arms meet the other's about equally, so neither's comparison is confounded."""
    plain = tuner(PAIRED_S)
    salted = tuner(replace(PAIRED_S, arm_salt="pair-knobs:"))
    ids = [f"req-{i}" for i in range(4000)]
    agree = sum(plain.arm_for(r) == salted.arm_for(r) for r in ids) / len(ids)
    assert 0.47 < agree < 0.53
    # unsalted, the same stream splits alike
    assert all(plain.arm_for(r) == tuner(PAIRED_S).arm_for(r) for r in ids[:200])
