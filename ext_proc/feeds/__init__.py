"""What the router hears from outside besides Envoy: RTT probes and engine load reports,
the engines' KV-event streams, and the other routers' dispatches (NATS). Decoders are pure;
clients are thin asyncio shells that call the router's public methods. May import: common,
config, core.
"""
