"""The routing core, pure and synchronous on an injected clock: shared types and
lifecycle events (leaves), the fleet's per-backend records, the per-candidate features,
the router that decides and closes, the fleet changes at run time, and the views for
/state. May import: common, config, prompt, estimate, learn, policy, feeds' pure decoders
(engine_metrics, kv_events, peers).
"""
