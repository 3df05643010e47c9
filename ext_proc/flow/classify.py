"""Which objective and tenant a request belongs to: the objective its header names, else
the one its model maps to, else the configured default; its tenant from the trusted
header ("" when none: one tenant); its deadline from its own SLO header or its
objective's."""

from __future__ import annotations

import math
from collections.abc import Mapping

from ext_proc.common.names import HEADER_GATEWAY_FAIRNESS_ID, HEADER_GATEWAY_OBJECTIVE
from ext_proc.config.flow import FlowControl, Objective
from ext_proc.vocab.types import RouteRequest

# A request of no configured objective: priority 0, no SLO, never shed early.
DEFAULT = Objective("default")
# Past this, an SLO header is not one (the queue's longest wait is far shorter).
MAX_SLO_MS = 24 * 3600 * 1000.0


class Objectives:
    """The configured objectives by name and by model."""

    def __init__(self, settings: FlowControl) -> None:
        self.settings = settings
        self.by_name = {o.name: o for o in settings.objectives}
        self.by_model = {m: o for o in settings.objectives for m in o.models}
        self.default = self.by_name.get(settings.default_objective, DEFAULT)

    def of(self, request: RouteRequest) -> Objective:
        named = self.by_name.get(request.objective)
        if named is not None:
            return named
        model = request.llm.model if request.llm is not None else None
        return self.by_model.get(model or "", self.default)

    def priorities(self) -> set[int]:
        """The priority bands requests can wait in."""
        return {o.priority for o in self.by_name.values()} | {self.default.priority}

    def protected_ms(self, o: Objective) -> float:
        """The tightest TTFT SLO of the bands above this one (inf: none): a request of
        this band goes where the prefill it puts ahead of theirs leaves half of it."""
        slos = [h.ttft_slo_ms for h in self.by_name.values() if h.priority > o.priority]
        return min((s for s in slos if s), default=math.inf) / 2

    def max_wait_s(self, o: Objective) -> float:
        return o.max_wait_s or self.settings.max_wait_s

    def deadline_s(self, o: Objective, request: RouteRequest, arrival_s: float) -> float:
        """Arrival plus the request's own SLO, else its objective's (inf: none)."""
        slo_ms = request.ttft_slo_ms or o.ttft_slo_ms
        return arrival_s + slo_ms / 1000 if slo_ms else math.inf


def read_headers(settings: FlowControl, headers: Mapping[str, str]) -> tuple[str, str, float]:
    """The objective, tenant and SLO (ms; 0 = none) a request's headers name: the
    configured headers, else the Gateway API Inference Extension's
    (x-gateway-inference-objective, x-gateway-inference-fairness-id), which its gateways
    set. A malformed or out-of-range SLO is no SLO (the objective's applies), as llm-d
    treats its x-llm-d-slo-ttft-ms."""
    raw = headers.get(settings.slo_header, "")
    try:
        slo_ms = float(raw) if raw else 0.0
    except ValueError:
        slo_ms = 0.0
    if not 0.0 < slo_ms <= MAX_SLO_MS or not math.isfinite(slo_ms):
        slo_ms = 0.0
    objective = (
        headers.get(settings.objective_header, "").strip()
        or headers.get(HEADER_GATEWAY_OBJECTIVE, "").strip()
    )
    tenant = (
        headers.get(settings.tenant_header, "").strip()
        or headers.get(HEADER_GATEWAY_FAIRNESS_ID, "").strip()
    )
    return objective, tenant[:200], slo_ms
