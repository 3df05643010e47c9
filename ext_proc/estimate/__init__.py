"""What a backend would do with a request, in milliseconds and tokens: the cost
formulas, the engine profiles, the router's prefix index, the engines' reported blocks,
and how right the predictions were. Pure. May import: vocab, prompt, feeds.
"""
