"""What a backend would do with a request, in milliseconds and tokens: the cost terms,
the engine profiles, the router's prefix index, the engines' reported blocks, and how
right the cached-token predictions were. Pure. May import: common, config.schema,
prompt, core.types and core.events (the lifecycle it listens to), feeds.kv_events (the
events' types).
"""
