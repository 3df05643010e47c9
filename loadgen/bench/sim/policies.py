"""The policies the benches compare: gorgo's two forms and the six baselines, in the order
their tables show them (`gorgo bench results`, `target`, `models`)."""

from loadgen.sim.rivals.names import AGGREGATED_RIVALS

POLICIES = (
    "gorgo",
    "gorgo_tokens",
    "least_request",
    "least_load",
    "session_affinity",
    "prefix_cache",
    "round_robin",
    "random",
)
BASELINES = tuple(p for p in POLICIES if not p.startswith("gorgo"))
# The rules of the routers users deploy instead (loadgen/sim/rivals), `gorgo bench target
# --against peers`: issue 50's bar, p95 TTFT <= 0.85 x the best of them.
RIVAL_BASELINES = AGGREGATED_RIVALS
# What each comparison's best baseline is picked from, and its TTFT target ratio.
AGAINST: dict[str, tuple[tuple[str, ...], float]] = {
    "paper": (BASELINES, 0.8),
    "peers": (RIVAL_BASELINES, 0.85),
}
