"""The WAN link's bandwidth, as pure pacing on a virtual clock (emulator/wan.py
DelayModel.schedule): a chunk leaves when the bytes ahead of it have left, at the link's
rate scaled by byte_scale, then takes half an RTT; 0 Gbit/s is today's unlimited link."""

from __future__ import annotations

import random

import pytest

from emulator.wan import DelayModel, DelaySettings, Pacing, SettingError

MIB = 1024 * 1024


def model(**settings: float) -> DelayModel:
    return DelayModel(DelaySettings(**{"rtt_ms": 0.0, **settings}), random.Random(1))


def test_unlimited_bandwidth_is_the_plain_delay() -> None:
    m, pacing = model(rtt_ms=40.0), Pacing()
    assert m.transmit_s(10 * MIB) == 0.0
    assert m.schedule(pacing, 1.0, 10 * MIB) == pytest.approx(1.020)
    assert m.schedule(pacing, 1.5, 10 * MIB) == pytest.approx(1.520)


def test_a_chunk_takes_its_bytes_at_the_rate_then_half_an_rtt() -> None:
    m = model(rtt_ms=100.0, gbps=0.008)  # 8 Mbit/s = 1 MB/s
    assert m.transmit_s(1_000_000) == pytest.approx(1.0)
    assert m.schedule(Pacing(), 10.0, 500_000) == pytest.approx(10.0 + 0.5 + 0.050)


def test_a_chunk_waits_for_the_bytes_ahead_of_it() -> None:
    m, pacing = model(gbps=0.008), Pacing()
    # Ten 100 kB chunks read at once leave one after another: the last after a second.
    dues = [m.schedule(pacing, 0.0, 100_000) for _ in range(10)]
    assert dues == pytest.approx([0.1 * (i + 1) for i in range(10)])
    # The wire idles once drained: a chunk read later starts at its read time.
    assert m.schedule(pacing, 5.0, 100_000) == pytest.approx(5.1)


def test_a_transfer_takes_rtt_plus_bytes_over_bandwidth_whatever_its_chunking() -> None:
    total = 4 * MIB
    for chunk in (1024, 64 * 1024, total):
        m, pacing = model(rtt_ms=90.0, gbps=1.0), Pacing()
        last = max(m.schedule(pacing, 0.0, chunk) for _ in range(total // chunk))
        assert last == pytest.approx(0.045 + total * 8 / 1e9)


def test_byte_scale_charges_each_byte_as_that_many() -> None:
    # 1 MiB standing for 1 GiB at 10 Gbit/s: the real GiB's time, 0.859 s.
    m = model(gbps=10.0, byte_scale=1024)
    assert m.schedule(Pacing(), 0.0, MIB) == pytest.approx(1024 * MIB * 8 / 10e9)


def test_a_new_bandwidth_applies_to_bytes_read_from_then_on() -> None:
    m, pacing = model(gbps=0.008), Pacing()
    assert m.schedule(pacing, 0.0, 1_000_000) == pytest.approx(1.0)
    m.settings = DelaySettings(0.0, gbps=0.016)
    # Queued behind the first megabyte (still on the wire until 1.0), then twice as fast.
    assert m.schedule(pacing, 0.5, 1_000_000) == pytest.approx(1.5)


def test_order_holds_when_the_rtt_drops_under_a_slow_wire() -> None:
    m, pacing = model(rtt_ms=400.0, gbps=0.008), Pacing()
    first = m.schedule(pacing, 0.0, 100_000)
    m.settings = DelaySettings(10.0, gbps=0.008)
    assert m.schedule(pacing, 0.0, 1) >= first


@pytest.mark.parametrize(
    ("changes", "key"),
    [({"gbps": -1}, "gbps"), ({"byte_scale": 0.5}, "byte_scale"), ({"gbps": "fast"}, "gbps")],
)
def test_bad_bandwidth_settings_name_their_key(changes: dict[str, object], key: str) -> None:
    with pytest.raises(SettingError) as info:
        DelaySettings(10.0).merged(changes)
    assert info.value.key == key


def test_the_bandwidth_is_a_setting_like_the_rtt() -> None:
    merged = DelaySettings(10.0).merged({"gbps": 2.5, "byte_scale": 1024})
    assert (merged.gbps, merged.byte_scale, merged.rtt_ms) == (2.5, 1024.0, 10.0)
    assert merged.as_dict()["gbps"] == 2.5
