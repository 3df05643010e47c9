"""Step 3's plugin seam: a policy chooses among candidates (`base`), the built-in ones
(`baselines`, `gorgo`) and the registry by name (`catalog`). May import: config.schema,
estimate.cost, core.types, prompt.tokens.
"""
