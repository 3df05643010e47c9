"""Prompts as the engine tokenizes them: its tokenizer.json and chat template, with a cache
so that a conversation's next turn tokenizes only what it added.

With `tokenizer.path` set, the shell turns each parsed request's text prompts (a chat:
through the chat template) into token-id prompts before the router sees them
(`PromptTokenizer.apply`), so the router counts real tokens and chains the very ids the
engines report in their KV events. Without it nothing here runs: the 4-bytes-per-token
approximation (ext_proc/prompt/tokens.py) serves.

The cache (`PromptCache`): a chat's turn n renders to a text that starts with turn n-1's
prompt (the earlier messages, then the new ones). Tokenizing only the new tail and
appending it to the cached ids equals tokenizing the whole text only when no token spans
the cut; a byte-level BPE merges across any ordinary character boundary (" \\n" + "\\nHi"
is not "\\n\\nHi"). The cut is therefore made right after a special token (ChatML's
`<|im_start|>`, `<|im_end|>`), where `tokenizers` itself splits the text before encoding
the pieces apart; `HfTokenizer.boundaries` checks that this holds for the tokenizer at hand
(otherwise every prompt is tokenized whole) and every reuse checks that the cached text is
exactly the new prompt's beginning. The ids come as `TokenIds` (ext_proc/prompt/tokens.py), packed
once for block hashing, the cached part's packing reused.

Pure and synchronous (no clock, no I/O after loading).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from ext_proc.prompt.chat_template import (
    TOKENIZER_CONFIG,
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
    template_in_config,
)
from ext_proc.prompt.tokenizer_config import TokenizerConfig
from ext_proc.prompt.tokens import Boundaries, HfTokenizer, TokenIds
from ext_proc.vocab.params import ConfigError
from ext_proc.vocab.request import Chat, LlmRequest, Prompt

log = logging.getLogger("gorgo.tokens")

# A cached prompt is found by the position of its cut and hashes of the first and the last
# EDGE_CHARS characters before it (a cheap key, O(1) per look-up whatever the prompt's
# length), then checked against the new prompt's whole beginning.
EDGE_CHARS = 256
# At most this many cut points are tried per prompt, from the last back (a chat turn adds
# a few special tokens; an agent's turn with many tool calls a few dozen).
MAX_PROBES = 1024
# The cache's memory, besides its count of entries: a paper-shaped chat's late turns are
# some 9k tokens, an entry ~180 kB (its text, the ids' tuple and their packing), so 512
# entries could hold ~90 MB (the engine twin's 180 MB after 4,000 such prompts). 64 MiB
# keeps the last turn of a few hundred long conversations, what multi-turn reuse needs.
MAX_CACHE_BYTES = 64 * 2**20
# An entry's bytes, counted: its text's characters plus, per id, the tuple's pointer and
# the packing's int64 (the int objects are mostly shared with the entry it grew from).
BYTES_PER_ID = 16


@dataclass(frozen=True)
class _Entry:
    """A tokenized prompt, kept whole (no copies): its text up to `cut` (right after a
    special token) tokenizes to its first `n_ids` ids."""

    text: str
    cut: int
    ids: TokenIds
    n_ids: int


@dataclass
class CacheStats:
    """The prompt cache's counters since start (prompts and tokens), shown in /state's
    `tokenizer` section: what its hits saved, and any cut point that did not line up."""

    # Prompts whose beginning was found tokenized, and the tokens reused; prompts
    # tokenized whole.
    hits: int = 0
    reused_tokens: int = 0
    misses: int = 0
    tokenized_tokens: int = 0
    # A cut point whose special tokens did not line up with the ids (not cached; never
    # expected when `boundaries` holds).
    mismatches: int = 0

    def as_json(self) -> dict[str, int]:
        return dict(vars(self))


class PromptCache:
    """Token ids of texts, reusing the ids of an earlier text that is the new one's
    beginning up to a special token. An LRU of earlier prompts bounded twice: at most
    `entries` of them and `max_bytes` in all (`entry_bytes`; one larger alone is not
    kept)."""

    def __init__(
        self,
        encode: Callable[[str], list[int]],
        boundaries: Boundaries | None,
        entries: int,
        max_bytes: int = MAX_CACHE_BYTES,
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"prompt cache: max_bytes must be >= 0, got {max_bytes}")
        self._encode = encode
        self._boundaries = boundaries if entries > 0 else None
        self._entries = entries
        self._max_bytes = max_bytes
        self._lru: OrderedDict[tuple[int, int, int], _Entry] = OrderedDict()
        self.bytes = 0
        self.stats = CacheStats()
        # A long prompt is tokenized in a worker thread while the loop tokenizes short
        # ones: the look-up and the remembering are locked, the encoding is not.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    @staticmethod
    def entry_bytes(text: str, n_ids: int) -> int:
        return len(text) + BYTES_PER_ID * n_ids

    @staticmethod
    def _key(text: str, cut: int) -> tuple[int, int, int]:
        return cut, hash(text[: min(cut, EDGE_CHARS)]), hash(text[max(0, cut - EDGE_CHARS) : cut])

    def ids(self, text: str) -> TokenIds:
        b = self._boundaries
        if b is None:
            whole = TokenIds(self._encode(text))
            with self._lock:
                self.stats.misses += 1
                self.stats.tokenized_tokens += len(whole)
            return whole
        cuts = [m.end() for m in b.pattern.finditer(text)]
        with self._lock:
            found = self._find(text, cuts)
        tail: list[int]
        if found is None:
            start = 0
            tail = self._encode(text)
            ids = TokenIds(tail)
        else:
            start, n = found.cut, found.n_ids
            tail = self._encode(text[start:])
            packed = b"".join((memoryview(found.ids.packed)[: 8 * n], TokenIds.pack(tail)))
            ids = TokenIds(found.ids[:n] + tuple(tail), packed)
        with self._lock:
            if found is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
                self.stats.reused_tokens += found.n_ids
            self.stats.tokenized_tokens += len(tail)
            self._remember(text, ids, [c for c in cuts if c > start], tail)
        return ids

    def _find(self, text: str, cuts: list[int]) -> _Entry | None:
        for cut in reversed(cuts[-MAX_PROBES:]):
            key = self._key(text, cut)
            entry = self._lru.get(key)
            if entry is not None and text.startswith(entry.text[:cut]):
                self._lru.move_to_end(key)
                return entry
        return None

    def _remember(self, text: str, ids: TokenIds, new_cuts: list[int], tail: list[int]) -> None:
        """Cache `text` as cut at its last special token. `tail`, the ids just tokenized
        (the end of `ids`), must hold as many of the special tokens as its text does."""
        b = self._boundaries
        if not new_cuts or b is None:
            return  # nothing past the reused part: its entry serves again
        if sum(map(b.ids.__contains__, tail)) != len(new_cuts):
            self.stats.mismatches += 1
            return
        n_ids = len(ids) - next(i for i, t in enumerate(reversed(tail)) if t in b.ids)
        cut = new_cuts[-1]
        key = self._key(text, cut)
        replaced = self._lru.pop(key, None)
        if replaced is not None:
            self.bytes -= self.entry_bytes(replaced.text, len(replaced.ids))
        self._lru[key] = _Entry(text, cut, ids, n_ids)
        self.bytes += self.entry_bytes(text, len(ids))
        while self._lru and (len(self._lru) > self._entries or self.bytes > self._max_bytes):
            _, old = self._lru.popitem(last=False)
            self.bytes -= self.entry_bytes(old.text, len(old.ids))


# Requests' own chat templates kept compiled (vLLM accepts one per request).
REQUEST_TEMPLATES = 8


class EngineTokenizer:
    """An engine's tokenizer and chat template, with the multi-turn cache."""

    def __init__(self, tokenizer: HfTokenizer, template: ChatTemplate, cache_entries: int) -> None:
        self.tokenizer = tokenizer
        self.template = template
        boundaries, why_not = tokenizer.boundaries()
        if boundaries is None and cache_entries > 0:
            log.warning(
                "%s: prompts are tokenized whole, no multi-turn reuse (%s)", tokenizer.name, why_not
            )
        self.cache = PromptCache(tokenizer.ids, boundaries, cache_entries)
        self.prefix_ids, self.suffix_ids = tokenizer.special_affixes()
        self._request_templates: OrderedDict[str, ChatTemplate] = OrderedDict()

    def _template_of(self, chat: Chat) -> ChatTemplate:
        if chat.template is None:
            return self.template
        compiled = self._request_templates.get(chat.template)
        if compiled is None:
            compiled = ChatTemplate(chat.template, self.template.special_tokens)
            self._request_templates[chat.template] = compiled
            while len(self._request_templates) > REQUEST_TEMPLATES:
                self._request_templates.popitem(last=False)
        return compiled

    def render(self, chat: Chat) -> str:
        return self._template_of(chat).render(
            chat.messages,
            chat.tools,
            chat.add_generation_prompt,
            chat.template_kwargs,
            chat.continue_final_message,
        )

    def text_ids(self, text: str, special: bool = False) -> TokenIds:
        """A text's ids; with `special`, the tokenizer's special tokens around them (a
        BOS, as the engine adds it when the request asks: vLLM's completions do)."""
        ids = self.cache.ids(text)
        if not special or not (self.prefix_ids or self.suffix_ids):
            return ids
        return TokenIds((*self.prefix_ids, *ids, *self.suffix_ids))

    def prompt_ids(self, prompt: Prompt, special: bool = False) -> tuple[int, ...]:
        return prompt if isinstance(prompt, tuple) else self.text_ids(prompt, special)

    def chat_ids(self, chat: Chat, special: bool = False) -> TokenIds:
        return self.text_ids(self.render(chat), special)

    def request_ids(self, llm: LlmRequest) -> tuple[tuple[int, ...], ...]:
        """Each prompt of a request as the engine tokenizes it."""
        special = llm.add_special_tokens
        if llm.chat is not None:
            return (self.chat_ids(llm.chat, special),)
        return tuple(self.prompt_ids(p, special) for p in llm.prompts)


class PromptTokenizer:
    """The shell's tokenization step: a parsed request -> the same request with token-id
    prompts and their real counts. Fails open: a request that cannot be rendered or
    tokenized keeps the approximation (and is counted)."""

    def __init__(self, engine: EngineTokenizer) -> None:
        self.engine = engine
        self.failures = 0
        # The last request tokenized with the engine's defaults, for a spot check against
        # the engine's own tokenizer: (its chat, or its one text prompt; the ids). Kept
        # in memory only, never logged or exposed.
        self.last: tuple[Chat | None, str | None, tuple[int, ...]] | None = None

    def apply(self, llm: LlmRequest, request_id: str = "") -> LlmRequest:
        try:
            ids = self.engine.request_ids(llm)
        except Exception as e:  # a template's own error, a bad message shape: never fatal
            self.failures += 1
            # The type and the template's message, never the prompt.
            log.warning(
                "request %s: not tokenized (%s: %.200s), approximated",
                request_id,
                type(e).__name__,
                e,
            )
            return llm
        if llm.chat is not None and not llm.add_special_tokens:
            self.last = (llm.chat, None, ids[0])
        elif llm.chat is None and llm.add_special_tokens and isinstance(llm.prompts[0], str):
            self.last = (None, llm.prompts[0], ids[0])
        prompts: tuple[Prompt, ...] = ids
        return replace(llm, prompts=prompts, prompt_tokens=tuple(len(p) for p in ids))

    def snapshot(self) -> dict[str, Any]:
        return {
            "name": self.engine.tokenizer.name,
            "cache_entries": len(self.engine.cache),
            "failures": self.failures,
            **self.engine.cache.stats.as_json(),
        }


def template_path(cfg: TokenizerConfig) -> Path:
    """The template file: tokenizer.chat_template, else the tokenizer_config.json beside
    tokenizer.path."""
    if cfg.chat_template:
        return Path(cfg.chat_template)
    return Path(cfg.path).parent / TOKENIZER_CONFIG


def check_tokenizer_files(cfg: TokenizerConfig, keys: tuple[str, str]) -> None:
    """Cheap checks for config loading: the files exist and a template is found. `keys`
    name the path and template settings in errors (config keys, or command-line flags)."""
    path_key, template_key = keys
    if not cfg.path:
        if cfg.chat_template:
            raise ConfigError(f"{template_key}: a chat template needs {path_key} (a tokenizer)")
        return
    if not Path(cfg.path).is_file():
        raise ConfigError(f"{path_key}: no such file {cfg.path}")
    template = template_path(cfg)
    if cfg.chat_template:
        if not template.is_file():
            raise ConfigError(f"{template_key}: no such file {template}")
        return
    try:
        found = template.is_file() and template_in_config(template) is not None
    except ChatTemplateError as e:
        raise ConfigError(f"{template_key}: {e}") from e
    if not found:
        raise ConfigError(
            f"{template_key}: required with {path_key} ({template} "
            f"{'has no chat_template' if template.is_file() else 'does not exist'}): name a "
            "Jinja template file or a tokenizer_config.json that carries chat_template"
        )


@lru_cache(maxsize=4)
def _load_parts(
    path: str, template: str, mtimes: tuple[float, float]
) -> tuple[HfTokenizer, ChatTemplate]:
    tokenizer = HfTokenizer(path)
    beside = Path(path).parent / TOKENIZER_CONFIG
    chat = load_chat_template(Path(template), beside if beside.is_file() else None)
    return tokenizer, chat


def load_engine_tokenizer(
    cfg: TokenizerConfig, keys: tuple[str, str] = ("tokenizer.path", "tokenizer.chat_template")
) -> EngineTokenizer | None:
    """The engine tokenizer the config names (None: the approximation). Errors are
    ConfigErrors naming the key and the file. The files are parsed once per process (the
    config check and the service share them); each call gets its own cache."""
    check_tokenizer_files(cfg, keys)
    if not cfg.path:
        return None
    path_key, template_key = keys
    template = template_path(cfg)
    try:
        tokenizer, chat = _load_parts(
            cfg.path, str(template), (Path(cfg.path).stat().st_mtime, template.stat().st_mtime)
        )
    except ChatTemplateError as e:
        raise ConfigError(f"{template_key}: {e}") from e
    except ValueError as e:  # HfTokenizer's errors name the file
        raise ConfigError(f"{path_key}: {str(e).removeprefix('tokenizer: ')}") from e
    return EngineTokenizer(tokenizer, chat, cfg.cache_entries)
