"""Envoy's side (steps 1, 4 and 5): the wire codec over our own minimal proto, the
per-stream sessions (each runs the recipe: director), the gateway queue's async shell,
the decision encoders, the access-log service and how each request ended, and the Envoy
bootstrap, filters, clusters and xDS files. May import: common, vocab, config, prompt,
feeds, core, flow, director.
"""
