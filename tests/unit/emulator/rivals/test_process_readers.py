"""Reading what SMG logs and exports (emulator/rivals/process.py), on lines in the shape SMG
1.13 writes them (policies/least_load.rs's decision line, observability/metrics.rs's
gauges); the peers tier reads the live ones."""

from __future__ import annotations

from pathlib import Path

from emulator.rivals.process import SmgDecision, smg_decisions, smg_engine_loads, smg_load_polls

W1, W2 = "http://127.0.0.1:41315", "http://127.0.0.1:44617"
LOG = (
    "\x1b[2m2026-12-05 13:45:42\x1b[0m \x1b[34mDEBUG\x1b[0m http_request{method=POST "
    'path=/v1/chat/completions request_id="chatcmpl-1"}: smg::policies::least_load: '
    "model_gateway/src/policies/least_load.rs:616: cache_aware selected "
    f"{W1} (score 7.8298, in_flight 0)\n"
    "2026-12-05 13:45:43  INFO smg::server: model_gateway/src/server.rs:1555: Starting\n"
    "2026-12-05 13:45:44 DEBUG http_request{}: smg::policies::least_load: "
    f"model_gateway/src/policies/least_load.rs:616: least_load selected {W2} "
    "(score 1.0250, in_flight 3)\n"
)
METRICS = f"""# TYPE smg_engine_waiting_requests gauge
smg_engine_waiting_requests{{worker="{W1}",model="alpha",dp_rank="0"}} 3
smg_engine_waiting_requests{{worker="{W2}",model="alpha",dp_rank="0"}} 0
smg_engine_gen_throughput{{worker="{W1}",model="alpha",dp_rank="0"}} 130.78
smg_engine_token_usage{{worker="{W1}",model="alpha",dp_rank="0"}} 0.25
smg_engine_token_usage{{worker="{W1}",model="alpha",dp_rank="1"}} 0.75
smg_engine_load_polls_total{{worker="{W1}",mode="poll"}} 4
smg_engine_load_polls_total{{worker="{W1}",mode="fallback"}} 1
smg_worker_requests_active{{worker="{W1}"}} 2
"""


def test_decisions_from_the_log(tmp_path: Path) -> None:
    log = tmp_path / "smg.log"
    log.write_text(LOG)
    assert smg_decisions(log) == [
        SmgDecision("cache_aware", W1, 7.8298, 0),
        SmgDecision("least_load", W2, 1.025, 3),
    ]


def test_engine_loads_and_polls_from_the_metrics() -> None:
    loads = smg_engine_loads(METRICS)
    assert loads[W1] == {"num_waiting_reqs": 3, "gen_throughput": 130.78, "token_usage": 0.5}
    assert loads[W2] == {"num_waiting_reqs": 0}
    assert smg_load_polls(METRICS) == {W1: 4}
