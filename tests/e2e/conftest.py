from __future__ import annotations

from collections.abc import Iterator

import pytest

from emulator.stack import Region, Stack, StackPorts, StackSettings

# Small RTTs and fast engines keep the tier quick; the network profile itself is tested
# with the WAN link's own tests.
FAST_REGIONS = (Region("us-ashburn", 1.0), Region("eu-frankfurt", 6.0), Region("ap-seoul", 12.0))
FAST_ENGINE = (
    "--prefill-base-ms", "2", "--prefill-tokens-per-s", "10000000", "--decode-ms-per-token", "1",
)  # fmt: skip


def start_stack(policy: str = "round_robin") -> Stack:
    stack = Stack(
        StackSettings(
            policy=policy,
            regions=FAST_REGIONS,
            ports=StackPorts.ephemeral(len(FAST_REGIONS)),
            engine_args=FAST_ENGINE,
        )
    )
    stack.start()
    return stack


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = start_stack()
    yield s
    s.stop()
