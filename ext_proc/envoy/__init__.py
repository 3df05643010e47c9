"""Envoy's side at run time (steps 1, 4 and 5): the wire codec over our own minimal proto,
the per-stream sessions, the decision encoders, the access-log service and how each
request ended. The config Envoy starts from is generated apart, in `envoy_config`. May
import: common, vocab, config, prompt, feeds, core, flow, director.
"""
