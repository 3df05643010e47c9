"""The policies the benches compare: gorgo's two forms and the six baselines, in the order
their tables show them (`gorgo bench results`, `target`, `models`)."""

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
