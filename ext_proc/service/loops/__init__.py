"""The running loops that feed the router from outside (each one a `vocab.feeds.Feed`:
started once, told of each backend added or removed, stopped once): RTT probes, engine
metrics and model lists (probe.py), the engines' KV events over ZMQ (kv_client.py,
kv_stream.py), and other routers' lifecycle events over NATS (fleet_bus.py). What they
read is decoded by the pure decoders of `ext_proc/feeds/`.
"""
