"""The config's `tokenizer:` section: how the router counts a prompt's tokens."""

from __future__ import annotations

from dataclasses import dataclass

from ext_proc.vocab.params import NON_NEGATIVE, bounded


@dataclass(frozen=True)
class TokenizerConfig:
    """How the router tokenizes prompts. Empty: 4 UTF-8 bytes per token (no file needed;
    ext_proc/prompt/tokens.py). Set: as the engines do (ext_proc/prompt/engine_tokens.py), so prompt
    lengths are real and precise prefix state matches the engines' own token ids."""

    # The engine's tokenizer.json (a local file; nothing is downloaded).
    path: str = ""
    # The chat template: a Jinja file, or a tokenizer_config.json carrying chat_template;
    # "" = the tokenizer_config.json beside `path`.
    chat_template: str = ""
    # Earlier prompts remembered (text and token ids) so a conversation's next turn
    # tokenizes only its new messages (0 = tokenize every prompt whole). About one entry
    # per conversation active now: 512 covers ~5 new turns a second with 100 s between a
    # conversation's turns. An entry costs ~20 bytes per token (the ids twice: a tuple and
    # packed for hashing; the text) besides the int objects, which a conversation's
    # entries share: ~650 KB for a 32k-token prompt, 330 MB if all 512 were that long.
    cache_entries: int = bounded(512, **NON_NEGATIVE)
