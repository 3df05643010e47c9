"""The emulated engine's tokenizer: by default the tiny model's own, as a model directory.

The real-vLLM tier serves a tiny model whose tokenizer is a byte-level BPE with a ChatML
template (emulator/vllm/tiny_model.py). The twin tokenizes with the very same files:
`tiny_tokenizer_dir` builds them once into a cache directory (`GORGO_CACHE_DIR`, else
`$XDG_CACHE_HOME/gorgo`, else `~/.cache/gorgo`), keyed by the seed, the `tokenizers`
version and the recipe, with `tokenizers` alone (~4 s, byte-identical to what the real
model's `save_pretrained` wrote). The directory holds tokenizer.json and a
tokenizer_config.json carrying `chat_template`, `eos_token` and `pad_token`, as a model
directory does; the engines report it as their model path (vLLM's `/v1/models` `root`,
SGLang's `/get_model_info`), so a router on the same machine can load the same files.

`load_twin_tokenizer` reads `gorgo engine --tokenizer`: `tiny` (the default), `approx` (one
token per 4 UTF-8 bytes, ext_proc/prompt/tokens.py) or a path (a tokenizer.json, or a model
directory that holds one).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from emulator.vllm.paths import TINY_MODEL
from ext_proc.prompt.chat_template import (
    TOKENIZER_CONFIG,
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
)
from ext_proc.prompt.engine_tokens import PromptCache, check_tokenizer_files, template_path
from ext_proc.prompt.tokenizer_config import TokenizerConfig
from ext_proc.prompt.tokens import (
    APPROX,
    HfTokenizer,
    TokenIds,
    Tokenizer,
    block_hashes_of_ids,
)
from ext_proc.vocab.params import ConfigError

TINY, APPROX_SPEC = "tiny", "approx"
TOKENIZER_JSON = "tokenizer.json"
CACHE_ENV = "GORGO_CACHE_DIR"
# Earlier prompts remembered so a chat's next turn tokenizes only its new messages (as the
# router's cache, ext_proc/config/schema.py TokenizerConfig): a 32k-token prompt costs
# ~650 KB, so 128 of them stay under ~85 MB per engine.
PROMPT_CACHE_ENTRIES = 128


def cache_root() -> Path:
    """Where built tokenizers are kept: $GORGO_CACHE_DIR, else $XDG_CACHE_HOME/gorgo, else
    ~/.cache/gorgo."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "gorgo"


def _tokenizers_version() -> str:
    import tokenizers

    return str(tokenizers.__version__)


def tiny_tokenizer_dir(seed: int = 0, root: Path | None = None) -> Path:
    """The tiny model's tokenizer files, built on first use (~4 s). Two processes may build
    at once: each writes a temporary directory and renames it into place; the first rename
    wins and the other's copy goes."""
    root = root or cache_root()
    recipe = hashlib.sha256(TINY_MODEL.read_bytes()).hexdigest()[:12]
    out = root / f"tiny-tokenizer-seed{seed}-tokenizers{_tokenizers_version()}-{recipe}"
    if (out / TOKENIZER_CONFIG).is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=root))
    try:
        # A child process: the recipe sets tokenizer environment variables on import.
        subprocess.run(
            [sys.executable, str(TINY_MODEL), str(tmp), "--seed", str(seed), "--tokenizer-only"],
            check=True,
            capture_output=True,
        )
        try:
            tmp.rename(out)
        except OSError:
            if not (out / TOKENIZER_CONFIG).is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


class TwinTokenizer:
    """A real tokenizer from a model directory's tokenizer.json, as the engine applies it:
    without special tokens for a rendered chat (the template wrote them), with them when
    the engine adds them (vLLM's completions default). Earlier prompts are reused
    (ext_proc/prompt/engine_tokens.py PromptCache): a chat's next turn tokenizes only what
    it added. Thread-safe: a prompt cache per thread (the engine tokenizes long prompts
    off its event loop)."""

    def __init__(self, tokenizer_json: Path, cache_entries: int = PROMPT_CACHE_ENTRIES) -> None:
        from tokenizers import Tokenizer as RawTokenizer

        self._hf = HfTokenizer(tokenizer_json)  # raises ValueError naming the file
        self.name = self._hf.name
        self.model_dir = tokenizer_json.resolve().parent
        self._raw = RawTokenizer.from_file(str(tokenizer_json))
        self._raw.no_truncation()
        self._raw.no_padding()
        # What a post-processor adds to every text (a BOS): SGLang probes encode("") the
        # same way (serving_chat.py _tokenizer_auto_adds_specials).
        self.adds_special_tokens = bool(self._raw.encode("", add_special_tokens=True).ids)
        self.model_max_length = _model_max_length(self.model_dir / TOKENIZER_CONFIG)
        self._boundaries, _ = self._hf.boundaries()
        self._entries = cache_entries
        self._local = threading.local()

    @property
    def cache(self) -> PromptCache:
        """This thread's prompt cache (an OrderedDict, not to be shared): the event loop's,
        and the tokenizing thread's for long prompts (emulator/engine/server.py)."""
        cache: PromptCache | None = getattr(self._local, "cache", None)
        if cache is None:
            encode = lambda text: self._encode(text, False)  # noqa: E731
            cache = self._local.cache = PromptCache(encode, self._boundaries, self._entries)
        return cache

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # The batch path without offsets: the same ids, ~2x faster than encode() here, and
        # it lets go of the GIL while it runs.
        (enc,) = self._raw.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        ids: list[int] = enc.ids
        return ids

    def encode(self, text: str, add_special_tokens: bool = False) -> tuple[int, ...]:
        """The token ids of `text` (`TokenIds`, packed for block hashing)."""
        if add_special_tokens and self.adds_special_tokens:
            return TokenIds(self._encode(text, True))
        return self.cache.ids(text)

    def ids(self, text: str) -> list[int]:
        return list(self.encode(text))

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def block_hashes(self, text: str, block_tokens: int) -> list[int]:
        return block_hashes_of_ids(self.encode(text), block_tokens)

    def token_strs(self, ids: Sequence[int]) -> list[str | None]:
        """The vocabulary's strings of `ids` (transformers' convert_ids_to_tokens)."""
        return [self._raw.id_to_token(i) for i in ids]


# transformers' model_max_length when a tokenizer_config.json names none
# (tokenization_utils_base.py VERY_LARGE_INTEGER).
VERY_LARGE_INTEGER = int(1e30)


def _model_max_length(tokenizer_config: Path) -> int:
    try:
        value = json.loads(tokenizer_config.read_text(encoding="utf-8")).get("model_max_length")
    except (OSError, ValueError, AttributeError):
        return VERY_LARGE_INTEGER
    return value if isinstance(value, int) and not isinstance(value, bool) else VERY_LARGE_INTEGER


@dataclass(frozen=True)
class TwinTokens:
    """What `--tokenizer` and `--chat-template` load: the tokenizer, its chat template
    (None with the approximation: the project's '<role>\\n<content>\\n' rendering) and the
    model directory the engine reports ("" with the approximation)."""

    tokenizer: Tokenizer
    template: ChatTemplate | None
    model_dir: str


def load_twin_tokenizer(
    spec: str = TINY,
    chat_template: str = "",
    seed: int = 0,
    keys: Sequence[str] = ("--tokenizer", "--chat-template"),
) -> TwinTokens:
    """The tokenizer `spec` names: tiny, approx, a tokenizer.json or a model directory.
    Errors are ConfigErrors naming the flag and the file."""
    path_key, template_key = keys
    if spec == APPROX_SPEC:
        if chat_template:
            raise ConfigError(f"{template_key}: a chat template needs a real {path_key}")
        return TwinTokens(APPROX, None, "")
    if spec in ("", TINY):
        tokenizer_json = tiny_tokenizer_dir(seed) / TOKENIZER_JSON
    else:
        given = Path(spec).expanduser()
        tokenizer_json = given / TOKENIZER_JSON if given.is_dir() else given
    cfg = TokenizerConfig(str(tokenizer_json), chat_template, cache_entries=0)
    check_tokenizer_files(cfg, (path_key, template_key))
    tokenizer = _load(str(tokenizer_json.resolve()), path_key)
    template = template_path(cfg)
    beside = tokenizer_json.parent / TOKENIZER_CONFIG
    try:
        chat = load_chat_template(template, beside if beside.is_file() else None)
    except ChatTemplateError as e:
        raise ConfigError(f"{template_key}: {e}") from e
    return TwinTokens(tokenizer, chat, str(tokenizer.model_dir))


@lru_cache(maxsize=4)
def _load(tokenizer_json: str, path_key: str) -> TwinTokenizer:
    # One per file and process: engines in one process (tests) share its prompt cache,
    # which is keyed by text and exact for any caller.
    try:
        return TwinTokenizer(Path(tokenizer_json))
    except ValueError as e:  # HfTokenizer's errors name the file
        raise ConfigError(f"{path_key}: {str(e).removeprefix('tokenizer: ')}") from e
