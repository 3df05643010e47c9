"""Step 2 of a request: the body read into an `LlmRequest` (parse), its tokens (the
approximation, or the engine's own tokenizer and chat template). May import: vocab.
"""
