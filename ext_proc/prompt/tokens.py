"""Tokens, shared by the router, the emulated engine and the load generator.

The default tokenizer is a fast, documented approximation: one token per 4 UTF-8 bytes,
rounded up. It costs O(1) to count (no scan), so the router can count a 128k-token prompt
in microseconds, and text synthesized by the load generator (4 bytes per token) reproduces
a trace's prompt lengths exactly. A real tokenizer is used instead when a local
`tokenizer.json` is configured (the `tokenizers` package; nothing is downloaded): the
router's `tokenizer:` section (ext_proc/prompt/engine_tokens.py), the emulator's `--tokenizer`.

Prompts are also cut into blocks of `block_tokens` tokens; each full block gets a chained
hash (it names the block and everything before it), which is what prefix caches match on.
Chat requests are counted and hashed on one rendered prompt, so every component that
renders the same messages gets the same tokens.
"""

from __future__ import annotations

import json
import re
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

BYTES_PER_TOKEN = 4
_LITTLE_ENDIAN = sys.byteorder == "little"


def _swapped(data: bytes) -> array[int]:
    a = array("I", data)
    a.byteswap()
    return a


def count_tokens(text: str | bytes) -> int:
    """Approximate token count of `text` (ceil(utf-8 bytes / 4))."""
    n_bytes = len(text) if isinstance(text, bytes) else _utf8_len(text)
    return -(-n_bytes // BYTES_PER_TOKEN)


def _utf8_len(text: str) -> int:
    # isascii() is a flag check in CPython: most prompts skip the encode copy.
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def _chain(pieces: Iterable[bytes | memoryview]) -> list[int]:
    """Chained 64-bit hashes: hash_i = H(hash_{i-1}, piece_i), with Python's own SipHash
    (3x faster than SHA-256 per block here: a 128k-token prompt hashes in ~0.3 ms). The
    values are process-local (Python salts them per process): each component keeps its
    own cache index and never exchanges hashes with another process."""
    out: list[int] = []
    prev = 0
    for piece in pieces:
        prev = hash((prev, hash(piece)))
        out.append(prev)
    return out


def block_hashes_of_bytes(data: bytes, block_tokens: int) -> list[int]:
    """Hashes of the full blocks of `data` under the 4-bytes-per-token approximation."""
    step = block_tokens * BYTES_PER_TOKEN
    view = memoryview(data)  # slices without copies (a read-only byte view is hashable)
    return _chain(view[i : i + step] for i in range(0, len(data) - step + 1, step))


def block_hashes_of_ids(ids: Sequence[int], block_tokens: int) -> list[int]:
    """Hashes of the full blocks of a token-id sequence (each block's ids packed as int64;
    `TokenIds` come packed already)."""
    if isinstance(ids, TokenIds):
        step = block_tokens * 8
        view = memoryview(ids.packed)  # the same bytes, hashed without a copy
        return _chain(view[i : i + step] for i in range(0, len(view) - step + 1, step))
    return _chain(
        array("q", ids[i : i + block_tokens]).tobytes()
        for i in range(0, len(ids) - block_tokens + 1, block_tokens)
    )


class TokenIds(tuple[int, ...]):
    """Token ids (a tuple, as a token-id prompt is) that also carry their int64 packing,
    the bytes block hashing reads: packing a 32k-token prompt's Python ints costs ~0.5 ms,
    and a prompt tokenized on top of a cached one packs only its new tail."""

    packed: bytes

    def __new__(cls, ids: Iterable[int], packed: bytes | None = None) -> TokenIds:
        self = super().__new__(cls, ids)
        self.packed = array("q", self).tobytes() if packed is None else packed
        return self

    @staticmethod
    def pack(ids: Sequence[int]) -> bytes:
        return array("q", ids).tobytes()


class Tokenizer(Protocol):
    """What the router needs of a tokenizer: token counts, ids, and block hashes for the
    prefix index. ApproxTokenizer (no file needed) and HfTokenizer (the engines' own
    tokenizer.json) implement it."""

    name: str

    def count(self, text: str) -> int: ...

    def ids(self, text: str) -> list[int]: ...

    def block_hashes(self, text: str, block_tokens: int) -> list[int]: ...


class ApproxTokenizer:
    """The default: 4 UTF-8 bytes per token. Its token ids are those 4 bytes read as a
    little-endian uint32 (the last token zero-padded): deterministic, and any two texts
    with a common 4-byte-aligned prefix share their leading ids, as real tokens do."""

    name = "approx-4-bytes"

    def count(self, text: str) -> int:
        return count_tokens(text)

    def ids(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        data += b"\0" * (-len(data) % BYTES_PER_TOKEN)
        return list(array("I", data)) if _LITTLE_ENDIAN else list(_swapped(data))

    def block_hashes(self, text: str, block_tokens: int) -> list[int]:
        return block_hashes_of_bytes(text.encode("utf-8"), block_tokens)


@dataclass(frozen=True)
class Boundaries:
    """Where a text can be cut so that its two pieces, tokenized apart, give the ids of the
    whole: right after one of these special tokens (see `HfTokenizer.boundaries`)."""

    # Finds the tokens' text (leftmost; the tokens never overlap one another).
    pattern: re.Pattern[str]
    ids: frozenset[int]


# Texts at least this long are tokenized without holding the GIL (`HfTokenizer.ids`).
GIL_FREE_CHARS = 16384
_PROBE_TEXT = "Hello world"


class HfTokenizer:
    """A real tokenizer from a local tokenizer.json (Hugging Face `tokenizers`)."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError as e:  # pragma: no cover - tokenizers is a dependency
            raise RuntimeError("a tokenizer.json needs the `tokenizers` package") from e
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"tokenizer: no such file {p}")
        try:
            self._tok = _Tok.from_file(str(p))
        except Exception as e:  # the library raises a bare Exception on bad files
            raise ValueError(f"tokenizer: {p} is not a tokenizer.json: {e}") from e
        # A count must see the whole prompt: a file's own truncation or padding would cut
        # or pad it (transformers turns both off unless a call asks for them).
        self._tok.no_truncation()
        self._tok.no_padding()
        self.name = f"{p.parent.name}/{p.name}"  # the model directory and the file
        self.path = p

    def ids(self, text: str) -> list[int]:
        # The chat template writes the special tokens itself: none added (as the engines
        # tokenize a rendered chat). Long texts go through encode_batch, which releases
        # the GIL while it works (encode holds it): a cold long prompt tokenized in a
        # worker thread then leaves the event loop free.
        if len(text) < GIL_FREE_CHARS:
            ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
            return ids
        return list(self._tok.encode_batch([text], add_special_tokens=False)[0].ids)

    def special_affixes(self) -> tuple[list[int], list[int]]:
        """What the tokenizer's post-processor puts before and after a text when special
        tokens are added (a BOS, say): the ids of `x` with them are prefix + ids + suffix."""
        bare = self._tok.encode(_PROBE_TEXT, add_special_tokens=False).ids
        full = self._tok.encode(_PROBE_TEXT, add_special_tokens=True).ids
        for start in range(len(full) - len(bare) + 1):
            if full[start : start + len(bare)] == bare:
                return full[:start], full[start + len(bare) :]
        raise ValueError(f"{self.name}: special tokens change the text's own tokens")

    def count(self, text: str) -> int:
        return len(self.ids(text))

    def block_hashes(self, text: str, block_tokens: int) -> list[int]:
        return block_hashes_of_ids(self.ids(text), block_tokens)

    def boundaries(self) -> tuple[Boundaries | None, str]:
        """The special tokens after which a text can be cut and its tail tokenized alone
        with the same result as tokenizing the whole, or None and the reason there are none.

        `tokenizers` first splits the text at its added tokens (those matched on the raw
        text, `normalized: false`), then normalizes, pre-tokenizes and encodes each piece
        between them on its own: no token spans such a split. A cut right after one is
        therefore exact, provided that (1) the token is found in the prefix alone just as
        in the whole: it absorbs no whitespace after it (`rstrip`), needs no word boundary
        after it (`single_word`), ends in no whitespace (an `lstrip` token could take it),
        and no added token contains it or starts inside it and runs past its end
        (leftmost-longest matching would pick that one in the whole);
        (2) no step treats the first piece of a text differently from the others
        (Metaspace's `prepend_scheme: first` prefixes only the text's start); (3) special
        tokens in the text are matched at all (`encode_special_tokens` off)."""
        if getattr(self._tok, "encode_special_tokens", False):
            return None, "encode_special_tokens is on: special tokens in text are not matched"
        doc = json.loads(self._tok.to_str())
        for part in ("normalizer", "pre_tokenizer"):
            if _first_only(doc.get(part)):
                return None, f"its {part} prefixes only the start of a text (prepend_scheme: first)"
        added = [
            (i, t) for i, t in self._tok.get_added_tokens_decoder().items() if not t.normalized
        ]
        contents = [t.content for _, t in added if t.content]
        joined = "\0".join(contents)
        prefixes = {c[:n] for c in contents for n in range(1, len(c))}
        safe = {}
        for i, t in added:
            c = t.content
            if not (t.special and c) or t.rstrip or t.single_word or c[-1].isspace():
                continue
            if joined.count(c) > 1 or any(c[n:] in prefixes for n in range(1, len(c))):
                continue  # another added token contains it or runs on from inside it
            safe[i] = c
        if not safe:
            return None, "no special token is a safe place to cut"
        alternatives = sorted(safe.values(), key=len, reverse=True)
        pattern = re.compile("|".join(re.escape(c) for c in alternatives))
        return Boundaries(pattern, frozenset(safe)), ""


def _first_only(component: Any) -> bool:
    """Whether a serialized normalizer or pre-tokenizer (or one in a Sequence) prefixes only
    the first piece of a text."""
    if isinstance(component, list):
        return any(_first_only(c) for c in component)
    if not isinstance(component, dict):
        return False
    if component.get("type") == "Metaspace" and component.get("prepend_scheme") == "first":
        return True
    return any(_first_only(component.get(k)) for k in ("normalizers", "pretokenizers"))


APPROX = ApproxTokenizer()


def _content_text(content: Any) -> str:
    """OpenAI message content: a string, or a list of parts of which text parts count."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, Mapping) and isinstance(part.get("text"), str)
        )
    return ""


def render_chat(messages: Iterable[Mapping[str, Any]]) -> str:
    """One prompt string for a chat: '<role>\\n<content>\\n' per message, then the
    assistant's turn marker. Plain concatenation keeps each earlier turn a byte prefix of
    the next turn's prompt, which is what makes multi-turn prefix caching visible."""
    parts = [f"{m.get('role', 'user')}\n{_content_text(m.get('content'))}\n" for m in messages]
    parts.append("assistant\n")
    return "".join(parts)
