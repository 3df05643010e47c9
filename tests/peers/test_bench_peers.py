"""`gorgo bench peers` end to end, briefly: gorgo and SMG cache_aware each in front of a
fresh emulated fleet, the same few seconds of paper-synthetic through each; the JSON holds
both in the shared schema, every request served, and SMG's decisions scored on the
engines' loads (its debug lines) with the engines polled for them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from emulator.rivals.install import DEFAULT_VENV, is_installed
from loadgen.bench.peers.run import RivalsOptions, run_rivals_bench

pytestmark = [
    pytest.mark.peers,
    pytest.mark.skipif(not is_installed(DEFAULT_VENV), reason="rivals not installed: make peers"),
]


def test_bench_rivals_runs_gorgo_and_smg_on_the_same_window(tmp_path: Path) -> None:
    out = tmp_path / "rivals.json"
    opts = RivalsOptions(
        "paper-synthetic",
        duration_s=3.0,
        time_scale=1.0,
        fronts=("gorgo", "smg:cache_aware"),
        out=str(out),
    )
    assert run_rivals_bench(opts) == 0
    doc = json.loads(out.read_text())
    assert set(doc["fronts"]) == {"gorgo", "smg:cache_aware"}
    assert doc["requests"] > 5
    for name, s in doc["fronts"].items():
        assert (s["requests"], s["errors"]) == (doc["requests"], 0), name
        assert s["ttft_ms"]["p95"] >= s["ttft_ms"]["p50"] > 0
        assert s["router_cpu_ms_per_request"] > 0 and s["router_peak_rss_mb"] > 10
        assert sum(s["engines"][0].values()) == doc["requests"]
    smg = doc["fronts"]["smg:cache_aware"]["evidence"][0]
    polls = int(smg.split("engine load polls ")[1].split(",")[0])
    scored = int(smg.split("scored on engine loads ")[1].split(",")[0])
    assert polls >= 3  # each engine's /v1/loads read at least once
    assert scored == doc["requests"]
    assert out.with_suffix(".png").stat().st_size > 1000
