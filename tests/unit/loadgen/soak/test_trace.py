"""The soak's workload: steady over the run (its memory windows compare like with like)."""

from loadgen.soak.run import TILE_S, SoakOptions, _trace


def test_the_load_is_steady_and_each_tile_its_own_users() -> None:
    trace = _trace(SoakOptions(minutes=30), 1800.0)
    assert len({r.index for r in trace}) == len(trace)
    tokens = [0] * 6
    for r in trace:
        tokens[int(r.arrival_s // TILE_S)] += r.input_tokens
    # one window over the run grew 3.4x from its first minutes to its last
    assert max(tokens[:5]) < 1.2 * min(tokens[:5]), tokens
    tiles = {r.session.split("-")[0] for r in trace}
    assert tiles == {str(k) for k in range(6)}
    blocks = [
        set(b for r in trace if r.arrival_s // TILE_S == k for b in r.block_ids) for k in (0, 1)
    ]
    assert not blocks[0] & blocks[1]  # no prefix shared across tiles by accident


def test_the_time_scale_stretches_the_rate() -> None:
    """--time-scale 2 is half the rate (its help): the users a tile holds, not only the
    gaps between their turns."""
    n = {ts: len(_trace(SoakOptions(minutes=10, time_scale=ts), 600.0)) for ts in (1.0, 2.0)}
    assert 0.4 < n[2.0] / n[1.0] < 0.6, n
