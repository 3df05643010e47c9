"""The assembled service: the composition root (`app`), the loops that feed the router
(`loops/`), the fleet shell that starts and stops them per backend and tells Envoy of
backend changes, the config reloader, the tuner state file, the admin HTTP API, the
operator's page and telemetry (spans, metrics). May import: common, vocab, config,
prompt, estimate, feeds, learn, policy, core, envoy, flow, director.
"""
