"""The config: its schema, how it is loaded and checked (strict decoding, checks across
fields, each policy's parameters, each profile and tokenizer named), and how it is written
back and compared on reload. May import: vocab, prompt, estimate, policy.
"""
