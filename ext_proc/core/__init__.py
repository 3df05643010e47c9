"""The routing core, pure and synchronous on an injected clock: the fleet's per-backend
records, the per-candidate features and cost terms, the router that decides and closes,
the learners that hear every outcome, the fleet changes at run time, and the views for
/state. May import: vocab, config, prompt, estimate, feeds, learn, policy.
"""
