"""The real tier's stack settings: real vLLM engines on free ports, probes and engine
scrapes quick enough for a test, the tuner off (each test adds what it needs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from emulator.stack.settings import Region, StackPorts, StackSettings


def real_settings(policy: str, regions: Sequence[Region], **extra: Any) -> StackSettings:
    settings: dict[str, Any] = {
        "probe_interval_s": 0.5,
        "metrics_interval_s": 0.2,
        "tuner_mode": "off",
        **extra,
    }
    return StackSettings(
        policy=policy,
        regions=tuple(regions),
        ports=StackPorts.ephemeral(len(regions)),
        real_engine=True,
        **settings,
    )
