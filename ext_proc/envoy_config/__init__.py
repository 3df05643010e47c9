"""Envoy's config, generated once and apart from the runtime that serves Envoy's streams:
the bootstrap of the front door (and the mesh snippet) with its listener and routes
(bootstrap.py), the ext_proc and access-log filters (filters.py), the clusters (clusters.py),
and the backend clusters written as CDS/EDS files that the router rewrites on fleet changes
(xds.py). May import: common, vocab, config.
"""
