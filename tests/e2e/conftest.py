from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from emulator.stack.settings import Region, StackPorts, StackSettings
from emulator.stack.stack import Stack

# Small RTTs and fast engines keep the tier quick; the network profile itself is tested
# with the WAN link's own tests.
FAST_REGIONS = (Region("us-ashburn", 1.0), Region("eu-frankfurt", 6.0), Region("ap-seoul", 12.0))
FAST_ENGINE = tuple(
    arg
    for setting in (
        "prefill_base_ms=2",
        "prefill_tokens_per_s=10000000",
        "decode_base_ms=1",
        "decode_batch_ms=0",
        "decode_per_request_ms=0",
        "decode_per_1k_context_ms=0",
    )
    for arg in ("--set", setting)
)


def fast_settings(
    policy: str = "round_robin",
    regions: Sequence[Region] = FAST_REGIONS,
    engine_args: Sequence[str] = FAST_ENGINE,
    **extra: Any,
) -> StackSettings:
    """The e2e tier's local stack: fast regions and engines on free ports; its temporary
    work directory removed when it stops (keep_logs=True keeps the logs, as gorgo up)."""
    return StackSettings(
        policy=policy,
        regions=regions,
        ports=StackPorts.ephemeral(len(regions)),
        engine_args=engine_args,
        **{"keep_logs": False, **extra},
    )


def start_stack(policy: str = "round_robin") -> Stack:
    stack = Stack(fast_settings(policy))
    stack.start()
    return stack


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = start_stack()
    yield s
    s.stop()
