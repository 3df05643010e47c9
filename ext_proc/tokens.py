"""Token counting shared by the router, the emulated engine and the load generator.

The default is a fast, documented approximation: one token per 4 UTF-8 bytes, rounded up.
It costs O(1) per string (no scan), so the router can count a 128k-token prompt in
microseconds, and text synthesized by the load generator (4 bytes per token) reproduces a
trace's prompt lengths exactly. Chat requests are counted on one rendered prompt, so every
component that renders the same messages gets the same count.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

BYTES_PER_TOKEN = 4


def count_tokens(text: str | bytes) -> int:
    """Approximate token count of `text` (ceil(utf-8 bytes / 4))."""
    n_bytes = len(text) if isinstance(text, bytes) else len(text.encode("utf-8"))
    return -(-n_bytes // BYTES_PER_TOKEN)


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
