"""Observability of every decision: a span per request (spans.py: its name and
attributes), Prometheus metrics updated on its lifecycle (metrics.py) and gauges read from
the router at scrape time (gauges.py), and the listener that ties them to the router's
lifecycle (listener.py). Never prompt text: counts, terms, ids and a hash of the session
key.
"""
