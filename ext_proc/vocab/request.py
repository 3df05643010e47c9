"""An LLM request as the router reads it: its prompts (text or token ids), their token
counts, its output budget, model and session, and a chat's messages for the engine's
template. Parsed from the body by `ext_proc/prompt/parse.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Text, or token ids.
Prompt = str | tuple[int, ...]


@dataclass(frozen=True)
class Chat:
    """A chat request as its chat template reads it (for a router that renders chats as the
    engine does: ext_proc/prompt/engine_tokens.py). Never logged, traced or exposed."""

    messages: tuple[Mapping[str, Any], ...]
    # What else vLLM hands the template: the request's tools, add_generation_prompt
    # (default true) and chat_template_kwargs.
    tools: tuple[Mapping[str, Any], ...] | None = None
    add_generation_prompt: bool = True
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # vLLM's chat request fields (vllm/entrypoints/openai/chat_completion/protocol.py):
    # the request's own template (None: the server's), and whether the final message is
    # continued (rendered open: no end of turn, no generation prompt).
    template: str | None = None
    continue_final_message: bool = False


@dataclass(frozen=True)
class LlmRequest:
    """An LLM request's body as the router reads it (ext_proc/prompt/parse.py): its prompts
    and their token counts, output budget, stream flag, model and session. Its prompts
    are never logged, traced or exposed."""

    api: str
    # The prompts as the engine will see them (one, or a batch; a chat is rendered). Used
    # for token counting and prefix hashing only: never logged, traced or exposed.
    prompts: tuple[Prompt, ...]
    # Tokens of each prompt (exact for token ids).
    prompt_tokens: tuple[int, ...]
    max_output_tokens: int | None
    stream: bool
    model: str | None
    # OpenAI `user` field: the session key when no x-session-id header is sent.
    user: str | None
    # A chat's messages (None for other APIs), for a tokenization step that renders them
    # with the engine's chat template; `prompts` holds the approximation's rendering.
    chat: Chat | None = None
    # Whether the engine adds the tokenizer's special tokens (BOS) to the prompt: the
    # request's `add_special_tokens`, else vLLM's default per API (completions true, chat
    # false: the template writes them).
    add_special_tokens: bool = False
    # vLLM's cache_salt: the engine keys the prompt's first block with it (a request with
    # another salt shares no cache).
    cache_salt: str | None = None
    # The client's own `priority` field (None: not sent or not an integer); the router
    # overwrites it for a backend whose engine it writes priorities for.
    priority: int | None = None

    @property
    def input_tokens(self) -> int:
        return sum(self.prompt_tokens)
