"""The load generator's data, no code: the first 400 requests of the Mooncake conversation
trace (README.md: where it comes from) and the fleet files of the benches. This file
imports nothing.
"""
