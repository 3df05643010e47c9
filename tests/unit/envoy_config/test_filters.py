"""The router's filters in the generated Envoy config: the access logs to the router split
failures (sent at once) from the rest (batched), with every response code in exactly one;
each request's start goes to a log of its own, which no completion reaches."""

from typing import Any

from ext_proc.envoy_config.bootstrap import build_envoy_config
from ext_proc.envoy_config.filters import access_logs
from tests.builders import make_config

START, END = "DownstreamStart", "DownstreamEnd"


def _passes(f: dict[str, Any], code: int, log_type: str) -> bool:
    """Whether Envoy's access-log filter `f` lets an entry through (the kinds used here)."""
    if "and_filter" in f:
        return all(_passes(g, code, log_type) for g in f["and_filter"]["filters"])
    if "log_type_filter" in f:
        t = f["log_type_filter"]
        return (log_type in t["types"]) != t.get("exclude", False)
    cmp = f["status_code_filter"]["comparison"]
    bound = cmp["value"]["default_value"]
    return bool({"GE": code >= bound, "LE": code <= bound}[cmp["op"]])


def test_failures_go_at_once_and_the_rest_in_batches_each_entry_once() -> None:
    logs = [
        log for log in access_logs() if log["typed_config"]["common_config"]["log_name"] == "gorgo"
    ]
    assert len(logs) == 2
    for code in (0, 200, 204, 399, 400, 404, 429, 500, 503):
        takers = [log for log in logs if _passes(log["filter"], code, END)]
        assert len(takers) == 1, code  # logged once: the router closes each request once
        buffered = takers[0]["typed_config"]["common_config"]["buffer_size_bytes"]
        assert (buffered == 0) == (code >= 400), code  # a failure is not held back
    for log in logs:
        common = log["typed_config"]["common_config"]
        assert common["buffer_flush_interval"] == "0.05s"
        assert log["typed_config"]["additional_response_headers_to_log"] == ["x-gorgo-backend"]


def test_a_requests_start_goes_only_to_the_log_of_starts_batched() -> None:
    # its stream is how the router sees an Envoy that never finished a request go away
    takers = [log for log in access_logs() if _passes(log["filter"], 0, START)]
    assert [t["typed_config"]["common_config"]["log_name"] for t in takers] == ["gorgo-starts"]
    assert takers[0]["typed_config"]["common_config"]["buffer_size_bytes"] > 0
    for code in (0, 200, 503):  # and no completion does
        assert not _passes(takers[0]["filter"], code, END)


def test_the_front_door_logs_each_request_as_it_starts() -> None:
    full = build_envoy_config(make_config())
    hcm = full["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    assert hcm["typed_config"]["access_log_options"] == {"flush_access_log_on_new_request": True}
    # the baseline without the router logs nothing to it
    bare = build_envoy_config(make_config(), ext_proc=False)
    hcm = bare["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    assert (
        "access_log_options" not in hcm["typed_config"] and hcm["typed_config"]["access_log"] == []
    )


def test_a_fleet_with_prefill_engines_lets_the_router_hold_its_reply_for_the_prefill_leg() -> None:
    from ext_proc.envoy_config.filters import ext_proc_filters

    def hold_s(**extra: Any) -> float:
        routing = ext_proc_filters(make_config("round_robin", **extra))[0]
        return float(routing["typed_config"]["max_message_timeout"].rstrip("s"))

    aggregated = hold_s(backends=["a", "b"])
    pd = [
        {"id": "p", "address": "127.0.0.1:8001", "role": "prefill"},
        {"id": "d", "address": "127.0.0.1:8002", "role": "decode"},
    ]
    assert hold_s(backends=pd, routing={"prefill_timeout_s": 120}) == 125.0
    assert hold_s(backends=pd, routing={"prefill_timeout_s": 1}) == aggregated  # the queue's
    assert hold_s(backends=["a", "b"], routing={"prefill_timeout_s": 120}) == aggregated


def test_the_prefill_engine_is_echoed_and_a_clients_copy_stripped() -> None:
    cfg = build_envoy_config(make_config("round_robin", backends=["a"]))
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    vhost = hcm["typed_config"]["route_config"]["virtual_hosts"][0]
    echoed = {h["header"]["key"]: h["header"]["value"] for h in vhost["response_headers_to_add"]}
    assert echoed["x-gorgo-prefill-backend"] == "%REQ(x-gorgo-prefill-backend)%"
    early = hcm["typed_config"]["early_header_mutation_extensions"][0]["typed_config"]
    assert {"remove": "x-gorgo-prefill-backend"} in early["mutations"]
