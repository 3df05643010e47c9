"""The (1+1)-ES tuner of the cost weights, with one strategy per mode, and its settings.
Pure. May import: vocab, config.
"""
