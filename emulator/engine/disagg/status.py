"""What the status endpoints show of P/D, pure (emulator/engine/status.py calls these).

SGLang:
- /server_info shows its server args: disaggregation_mode ("null", "prefill", "decode"),
  disaggregation_bootstrap_port, disaggregation_transfer_backend,
  num_reserved_decode_tokens (server_args.py; entrypoints/http_server.py get_server_info).
- /v1/loads' "disaggregation" section: mode, prefill_bootstrap_queue_reqs,
  prefill_inflight_queue_reqs, decode_prealloc_queue_reqs, decode_transfer_queue_reqs,
  decode_retracted_queue_reqs, kv_transfer_speed_gb_s, kv_transfer_latency_ms (the
  scheduler's get_loads; the last transfer's figures, from the prefill).
- /metrics labels every scheduler series engine_type "prefill", "decode" or "unified"
  (scheduler_metrics_mixin.py init_metrics) and, in P/D mode, adds the queue gauges
  sglang:num_prefill_bootstrap_queue_reqs, _prefill_inflight_, _decode_prealloc_,
  _decode_transfer_, the counters sglang:num_bootstrap_failed_reqs_total and
  sglang:num_transfer_failed_reqs_total, and the histograms sglang:kv_transfer_speed_gb_s
  and sglang:kv_transfer_latency_ms (metrics/collector.py SchedulerMetricsCollector).

vLLM: /metrics with a NIXL connector adds vllm:nixl_xfer_time_seconds and
vllm:nixl_bytes_transferred (histograms, observed on the decode), and the counters
vllm:nixl_num_failed_transfers_total, vllm:nixl_num_failed_notifications_total and
vllm:nixl_num_kv_expired_reqs_total (the latter on the prefill) (kv_connector/v1/nixl
stats.py NixlPromMetrics). vLLM has no /server_info outside dev mode; the twin's own shows
the kv_transfer_config and the role.

The twin's own /stats adds, on a decode, the KV it received by the address each prefill
named for its side server (`kv_received_from`): which prefill engine each pair had.
"""

from __future__ import annotations

from typing import Any

from emulator.engine.disagg.config import NULL, SGLANG, DisaggConfig
from emulator.engine.disagg.prebuilt import PrebuiltModel
from emulator.engine.model.scheduler import EngineModel


def engine_type(disagg: DisaggConfig | None) -> str:
    """SGLang's engine_type metric label."""
    return "unified" if disagg is None or disagg.mode == NULL else disagg.mode


def server_info_args(disagg: DisaggConfig | None, flavor: str) -> dict[str, Any]:
    if flavor == SGLANG:
        d = disagg or DisaggConfig.sglang(NULL)
        return {
            "disaggregation_mode": d.mode,
            "disaggregation_bootstrap_port": d.bootstrap_port,
            "disaggregation_transfer_backend": d.transfer_backend,
            "num_reserved_decode_tokens": d.reserved_decode_tokens,
        }
    return {
        "disaggregation_mode": NULL if disagg is None else disagg.mode,
        "kv_transfer_config": None if disagg is None else disagg.kv_transfer_config,
    }


def loads_section(disagg: DisaggConfig | None, m: EngineModel) -> dict[str, Any]:
    """/v1/loads' "disaggregation" section."""
    s = m.disagg if isinstance(m, PrebuiltModel) else None
    return {
        "mode": NULL if disagg is None else disagg.mode,
        "prefill_bootstrap_queue_reqs": s.prefill_bootstrap if s else 0,
        "prefill_inflight_queue_reqs": s.prefill_inflight if s else 0,
        "decode_prealloc_queue_reqs": s.decode_prealloc if s else 0,
        "decode_transfer_queue_reqs": s.decode_transfer if s else 0,
        "decode_retracted_queue_reqs": 0,
        "kv_transfer_speed_gb_s": round(s.last_speed_gb_s, 2) if s else 0.0,
        "kv_transfer_latency_ms": round(s.last_latency_ms, 2) if s else 0.0,
    }


def metrics_lines(disagg: DisaggConfig | None, m: EngineModel, labels: str) -> list[str]:
    """The P/D series of the /metrics page (none when not disaggregated)."""
    if disagg is None or not disagg.active or not isinstance(m, PrebuiltModel):
        return []
    s = m.disagg
    lines: list[str] = []
    if disagg.flavor == SGLANG:
        for name, value in (
            ("sglang:num_prefill_bootstrap_queue_reqs", s.prefill_bootstrap),
            ("sglang:num_prefill_inflight_queue_reqs", s.prefill_inflight),
            ("sglang:num_decode_prealloc_queue_reqs", s.decode_prealloc),
            ("sglang:num_decode_transfer_queue_reqs", s.decode_transfer),
        ):
            lines += [f"# TYPE {name} gauge", f"{name}{{{labels}}} {value}"]
        for name, value in (
            ("sglang:num_bootstrap_failed_reqs_total", s.bootstrap_failed),
            ("sglang:num_transfer_failed_reqs_total", s.transfer_failed),
        ):
            lines += [f"# TYPE {name} counter", f"{name}{{{labels}}} {value}"]
        lines += s.speed_gb_s.prometheus("sglang:kv_transfer_speed_gb_s", labels)
        lines += s.latency_ms.prometheus("sglang:kv_transfer_latency_ms", labels)
        return lines
    lines += s.xfer_s.prometheus("vllm:nixl_xfer_time_seconds", labels)
    lines += s.engine_bytes.prometheus("vllm:nixl_bytes_transferred", labels)
    for name, value in (
        ("vllm:nixl_num_failed_transfers_total", s.transfer_failed),
        ("vllm:nixl_num_failed_notifications_total", 0),
        ("vllm:nixl_num_kv_expired_reqs_total", s.kv_expired),
    ):
        lines += [f"# TYPE {name} counter", f"{name}{{{labels}}} {value}"]
    return lines


def stats_section(m: EngineModel | None) -> dict[str, Any]:
    """The twin's own /stats additions: a decode's `kv_received_from` (address -> count);
    nothing for an engine without P/D."""
    if not isinstance(m, PrebuiltModel):
        return {}
    return {"kv_received_from": dict(m.disagg.received_from)}
