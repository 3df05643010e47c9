"""The router's filters in the generated Envoy config: the access logs to the router split
failures (sent at once) from the rest (batched), with every response code in exactly one."""

from typing import Any

from ext_proc.envoy.filters import access_logs


def _accepts(log: dict[str, Any], code: int) -> bool:
    cmp = log["filter"]["status_code_filter"]["comparison"]
    bound = cmp["value"]["default_value"]
    return bool({"GE": code >= bound, "LE": code <= bound}[cmp["op"]])


def test_failures_go_at_once_and_the_rest_in_batches_each_entry_once() -> None:
    logs = access_logs()
    assert len(logs) == 2
    for code in (0, 200, 204, 399, 400, 404, 429, 500, 503):
        takers = [log for log in logs if _accepts(log, code)]
        assert len(takers) == 1, code  # logged once: the router closes each request once
        buffered = takers[0]["typed_config"]["common_config"]["buffer_size_bytes"]
        assert (buffered == 0) == (code >= 400), code  # a failure is not held back
    for log in logs:
        common = log["typed_config"]["common_config"]
        assert common["log_name"] == "gorgo" and common["buffer_flush_interval"] == "0.05s"
        assert log["typed_config"]["additional_response_headers_to_log"] == ["x-gorgo-backend"]
