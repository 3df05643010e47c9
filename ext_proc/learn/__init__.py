"""What the router learns from outcomes (step 6): the lifecycle listeners (prefix index,
prefill model, ejection, the tuner's samples) and the (1+1)-ES tuner with one strategy per
mode. Pure. May import: config.schema, estimate, core.types, core.events, core.state.
"""
