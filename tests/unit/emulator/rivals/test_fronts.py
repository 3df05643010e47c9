"""The rival configurations and their command lines (emulator/rivals/fronts.py). Each flag
is checked against the pinned tools' --help in tests/peers (the peers tier)."""

from __future__ import annotations

from pathlib import Path

import pytest

from emulator.rivals.fronts import (
    DEFAULT_FRONTS,
    FRONTS,
    GORGO,
    PD_FRONTS,
    PdWorkers,
    argv,
    default_throughput_tok_s,
    front,
)
from ext_proc.estimate.profile import load_profile

WORKERS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
VENV = Path("/v")


def test_the_default_set_is_known_and_gorgo_first() -> None:
    assert DEFAULT_FRONTS[0] == GORGO
    assert len(set(DEFAULT_FRONTS)) == len(DEFAULT_FRONTS)
    for name in DEFAULT_FRONTS[1:]:
        assert FRONTS[name].name == name
    for name, f in FRONTS.items():
        assert name == f"{f.tool}:{'pd' if f.pd_protocol else f.policy}"
        assert f.reason.strip() and "\n" not in f.reason
    assert set(PD_FRONTS) == {"smg:pd", "vllm-router:pd"}
    assert not set(PD_FRONTS) & set(DEFAULT_FRONTS)  # the aggregated bench's set as before


def test_session_headers() -> None:
    assert FRONTS["vllm-router:sticky_least_loaded"].session_header == "x-session-id"
    assert FRONTS["smg:consistent_hashing"].session_header == "x-smg-routing-key"
    assert FRONTS["smg:cache_aware"].session_header is None


def test_smg_command_line() -> None:
    cmd = argv(FRONTS["smg:cache_aware"], WORKERS, "m", 18000, 18001, venv=VENV)
    assert cmd[:2] == ["/v/bin/smg", "launch"]
    text = " ".join(cmd)
    assert "--port 18000" in text and "--prometheus-port 18001" in text
    assert "--prometheus-host 127.0.0.1" in text and "--host 127.0.0.1" in text
    assert f"--worker-urls {WORKERS[0]} {WORKERS[1]} --policy cache_aware" in text
    assert "--worker-startup-check-interval 1" in text
    assert "--model-alias" not in cmd  # clients ask for the served name
    aliased = argv(FRONTS["smg:cache_aware"], WORKERS, "m", 1, 2, venv=VENV, served_model="qwen")
    assert aliased[aliased.index("--model-alias") + 1] == "m=qwen"


def test_least_load_needs_its_throughput() -> None:
    f = FRONTS["smg:least_load"]
    assert f.facts() == ("default_throughput_tok_s",)
    with pytest.raises(ValueError, match="default_throughput_tok_s"):
        argv(f, WORKERS, "m", 1, 2, venv=VENV)
    cmd = argv(f, WORKERS, "m", 1, 2, venv=VENV, default_throughput_tok_s=812.5)
    assert cmd[cmd.index("--least-load-default-throughput") + 1] == "812.5"
    assert cmd[cmd.index("--load-monitor-interval") + 1] == "2"


def test_round_robin_turns_the_veto_off_and_vllm_router_has_no_launch() -> None:
    assert "--disable-worker-overload-protection" in argv(
        FRONTS["smg:round_robin"], WORKERS, "m", 1, 2, venv=VENV
    )
    cmd = argv(FRONTS["vllm-router:cache_aware"], WORKERS, "m", 1, 2, venv=VENV)
    assert cmd[0] == "/v/bin/vllm-router" and "launch" not in cmd
    assert "--model-alias" not in cmd


def test_bad_inputs_are_named() -> None:
    f = FRONTS["smg:cache_aware"]
    with pytest.raises(ValueError, match="no worker URLs"):
        argv(f, [], "m", 1, 2)
    with pytest.raises(ValueError, match="metrics_port 70000"):
        argv(f, WORKERS, "m", 1, 70000)
    with pytest.raises(ValueError, match="both 5"):
        argv(f, WORKERS, "m", 5, 5)
    with pytest.raises(ValueError, match="unknown rival front 'smg:nope'"):
        front("smg:nope")


def test_throughput_from_the_profile() -> None:
    p = load_profile()
    tput = default_throughput_tok_s(p)
    b = p.max_running_requests
    assert tput == round(b / p.decode_ms(b, b * 2048) * 1e3, 1)
    # a bigger batch decodes more tokens per second on every shipped profile
    assert default_throughput_tok_s(p, batch=1) < tput
    with pytest.raises(ValueError, match="batch"):
        default_throughput_tok_s(p, batch=0)


PD = PdWorkers(
    (("http://127.0.0.1:9101", 9201), ("http://127.0.0.1:9102", 9202)),
    ("http://127.0.0.1:9001", "http://127.0.0.1:9002"),
)


def test_the_pd_fronts_speak_one_protocol_each_with_cache_aware_on_each_leg() -> None:
    smg, vllm = FRONTS["smg:pd"], FRONTS["vllm-router:pd"]
    assert (smg.pd_protocol, vllm.pd_protocol) == ("sglang", "vllm")
    for f in (smg, vllm):
        assert f.policy == "cache_aware" and f.session_header is None
        cmd = argv(f, [], "m", 1, 2, venv=VENV, pd_workers=PD)
        assert cmd[cmd.index("--prefill-policy") + 1] == "cache_aware"
        assert cmd[cmd.index("--decode-policy") + 1] == "cache_aware"
        assert cmd[cmd.index("--policy") + 1] == "cache_aware"
        assert "--worker-urls" not in cmd
    assert FRONTS["smg:cache_aware"].pd_protocol is None


def test_smg_pd_command_line_names_each_prefill_with_its_bootstrap_port() -> None:
    cmd = argv(FRONTS["smg:pd"], [], "m", 1, 2, venv=VENV, pd_workers=PD, served_model="q")
    assert cmd[:3] == ["/v/bin/smg", "launch", "--host"]
    assert "--pd-disaggregation" in cmd and "--vllm-pd-disaggregation" not in cmd
    text = " ".join(cmd)
    assert (
        "--prefill http://127.0.0.1:9101 9201 --prefill http://127.0.0.1:9102 9202 "
        "--decode http://127.0.0.1:9001 --decode http://127.0.0.1:9002 --policy cache_aware"
    ) in text
    assert cmd[cmd.index("--model-alias") + 1] == "m=q"


def test_vllm_router_pd_command_line_names_prefills_without_a_port() -> None:
    nixl = PdWorkers((("http://127.0.0.1:9101", None),), ("http://127.0.0.1:9001",))
    cmd = argv(FRONTS["vllm-router:pd"], [], "m", 1, 2, venv=VENV, pd_workers=nixl)
    assert cmd[0] == "/v/bin/vllm-router" and "launch" not in cmd
    assert "--vllm-pd-disaggregation" in cmd and "--pd-disaggregation" not in cmd
    i = cmd.index("--prefill")
    assert cmd[i : i + 4] == [
        "--prefill",
        "http://127.0.0.1:9101",
        "--decode",
        "http://127.0.0.1:9001",
    ]
    assert len(nixl) == 2 and len(PD) == 4


def test_pd_workers_go_to_pd_fronts_only() -> None:
    with pytest.raises(ValueError, match="prefill and decode workers needed"):
        argv(FRONTS["smg:pd"], [], "m", 1, 2)
    with pytest.raises(ValueError, match="prefill and decode workers needed"):
        argv(FRONTS["smg:pd"], [], "m", 1, 2, pd_workers=PdWorkers(PD.prefills, ()))
    with pytest.raises(ValueError, match="not worker URLs"):
        argv(FRONTS["smg:pd"], WORKERS, "m", 1, 2, pd_workers=PD)
    with pytest.raises(ValueError, match="not a P/D front"):
        argv(FRONTS["smg:cache_aware"], WORKERS, "m", 1, 2, pd_workers=PD)
