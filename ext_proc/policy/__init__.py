"""Step 3's plugin seam: the built-in policies (`baselines`, `gorgo`) and the registry by
name (`base`, `catalog`); what a policy is lives in `vocab.policy`. May import: vocab,
prompt, estimate.
"""
