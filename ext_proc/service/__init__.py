"""The assembled service, a room per what it serves: the composition root (`app`) and at
the top what serves it all (the fleet shell that starts and stops the feeds per backend
and tells Envoy of backend changes, readiness and the gRPC health service, the config
reloader and the last good config, the tuner state file, the collector's schedule, the
engine's tokenizer found and checked); the loops that feed the router (`loops/`), the
admin HTTP API and the operator's page (`admin/`), telemetry (`telemetry/`: spans,
metrics, the OTLP exporter), the endpoint picker (`epp/`: `gorgo epp`) and `gorgo check`
(`check/`). May import: common, vocab, config, prompt, estimate, feeds, learn, policy,
core, envoy, envoy_config, flow, director.
"""
