"""The assembled service: the composition root (`app`), the fleet shell that tells
Envoy of backend changes, the config reloader, the tuner state file, the admin HTTP API
and telemetry (spans, metrics). May import: everything in ext_proc but cli.
"""
