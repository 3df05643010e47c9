"""The config: its schema (a leaf), how it is loaded and checked, and how it is written
back and compared on reload. May import: common, estimate.profile (the profiles' names),
prompt (checks a configured tokenizer), policy (decodes `policies.<name>`).
"""
