"""A P/D fleet as a rival is given it (its workers by role) and where a front's legs went,
from the twins' /stats (`gorgo bench peers --pd`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from emulator.rivals.fronts import PdWorkers
from emulator.stack.stack import Stack
from ext_proc.vocab.backend import BackendRole, EngineKind


def pd_workers(stack: Stack) -> PdWorkers:
    """A P/D rival's workers: the backends the router is given, by role (the same
    addresses: the twins behind their front-door links; an SGLang prefill's bootstrap
    port, which vLLM's have none of)."""
    prefills, decodes = [], []
    for b in stack.config.backends:
        url = f"http://{b.address}"
        if b.role is BackendRole.PREFILL:
            sglang = b.engine is EngineKind.SGLANG
            prefills.append((url, b.bootstrap_port if sglang else None))
        elif b.role is BackendRole.DECODE:
            decodes.append(url)
    return PdWorkers(tuple(prefills), tuple(decodes))


def pd_legs(stack: Stack, stats: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Where a P/D front's legs went, from the twins' /stats: the requests each prefill
    twin completed (prefill legs) and each decode twin (decodes, paired or whole), the
    pairs (prefill region -> decode region: the KV each decode received, by the address
    each prefill advertises), how many crossed regions, and the decodes served whole."""
    pd, regions = stack.settings.pd_layout(), [r.id for r in stack.settings.regions]
    region_of = {pd.advertised(a): regions[a] for a in range(pd.n)}
    by_name = {s["name"]: s for s in stats}
    decodes = {r: int(by_name[r]["completed_total"]) for r in regions}
    prefills = {f"{r}-prefill": int(by_name[f"{r}-prefill"]["completed_total"]) for r in regions}
    pairs: Counter[str] = Counter()
    for b in regions:
        for addr, n in by_name[b].get("kv_received_from", {}).items():
            pairs[f"{region_of.get(addr, addr)}->{b}"] += int(n)
    paired = sum(pairs.values())
    cross = sum(n for k, n in pairs.items() if len(set(k.split("->"))) == 2)
    return {
        "prefill": prefills,
        "decode": decodes,
        "pairs": dict(sorted(pairs.items())),
        "paired": paired,
        "cross_region": cross,
        "whole": sum(decodes.values()) - paired,
    }


def legs_line(legs: Mapping[str, Any]) -> str:
    """pd_legs in a line for the log."""
    return (
        f"prefill legs {legs['prefill']}, decodes {legs['decode']}, pairs {legs['pairs']} "
        f"({legs['cross_region']}/{legs['paired']} across regions, {legs['whole']} whole)"
    )
