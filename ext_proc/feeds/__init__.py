"""What the router hears from outside besides Envoy, decoded: engine load reports
(engine_metrics.py), model lists (served_models.py), SGLang's priority scheduling and
what the router writes for it (server_info.py), KV cache events (kv_events.py), other
routers' lifecycle events (peers.py). Pure decoders and their value types; the loops that
fetch them are the service's (`ext_proc/service/loops/`). May import: vocab.
"""
