"""A chat request's prompt text as each engine renders it from the model's chat template
(ext_proc/prompt/chat_template.py evaluates the template as transformers does), and
whether the engine then adds the tokenizer's special tokens when it encodes that text.

vLLM (renderers/chat_utils.py, renderers/hf.py, chat_completion/protocol.py): the request's
`add_generation_prompt` (default true), `continue_final_message` (default false; not both),
`add_special_tokens` (default false), `chat_template` (only with
--trust-request-chat-template), `chat_template_kwargs` and `tools`; assistant tool calls'
`arguments` given as JSON strings are parsed to objects first (a malformed or non-object
one becomes {}).

SGLang (entrypoints/openai/serving_chat.py `_apply_jinja_template`): always a generation
prompt; a last assistant message with text content is continued (`continue_final_message`:
removed, its text appended to the rendered prompt) or else sent as a user message; tool
calls' string `arguments` must be JSON objects (400 otherwise); `tools` only when
`tool_choice` is not "none" (only the named one when it names one); the text is encoded
without special tokens.

Pure (no I/O).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from emulator.engine.config import VLLM, EngineConfig
from ext_proc.prompt.chat_template import ChatTemplate, ChatTemplateError, content_text
from ext_proc.prompt.tokens import render_chat


class ChatError(ValueError):
    """The engine refuses the chat (answered with HTTP 400); `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# transformers marks the end of the message to continue with this, renders, and cuts the
# text there (utils/chat_template_utils.py render_jinja_template).
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)  # vLLM renderers/online_renderer.py validate_chat_template


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ChatError(f"'{key}' must be a boolean, got {type(value).__name__}", key)
    return value


def chat_prompt(
    body: Mapping[str, Any], messages: list[Any], cfg: EngineConfig
) -> tuple[str, bool]:
    """The prompt text of a chat request (or a vLLM /tokenize chat body) and whether the
    engine adds special tokens when it encodes it. Raises ChatError."""
    if cfg.chat_template is None:  # the approximation: the project's own rendering
        return render_chat(messages), False
    if cfg.flavor == VLLM:
        return _vllm_prompt(body, messages, cfg)
    return _sglang_prompt(body, messages, cfg)


@lru_cache(maxsize=16)
def _compiled(source: str, specials: tuple[tuple[str, str], ...]) -> ChatTemplate:
    return ChatTemplate(source, dict(specials))


def _vllm_template(body: Mapping[str, Any], cfg: EngineConfig) -> ChatTemplate:
    assert cfg.chat_template is not None
    source = body.get("chat_template")
    kwargs = body.get("chat_template_kwargs")
    in_kwargs = isinstance(kwargs, Mapping) and kwargs.get("chat_template") is not None
    if (source is not None or in_kwargs) and not cfg.trust_request_chat_template:
        raise ChatError(UNTRUSTED_TEMPLATE)
    if source is None:
        return cfg.chat_template
    if not isinstance(source, str):
        raise ChatError("'chat_template' must be a string", "chat_template")
    try:
        specials = tuple(sorted(cfg.chat_template.special_tokens.items()))
        return _compiled(source, specials)
    except ChatTemplateError as e:
        raise ChatError(str(e), "chat_template") from None


def _vllm_tool_calls(message: dict[str, Any]) -> None:
    """vLLM renderers/chat_utils.py _postprocess_messages, in place."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not isinstance(calls, list):
        return
    if not calls:  # an empty list: the template's plain assistant path
        del message["tool_calls"]
        return
    parsed_calls = []
    for item in calls:
        if not isinstance(item, Mapping):
            raise ChatError("assistant tool_calls entries must be objects.", "tool_calls")
        function = item.get("function")
        if item.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise ChatError(
                "chat completions only support assistant tool_calls of type 'function'.",
                "tool_calls",
            )
        args = function.get("arguments")
        if isinstance(args, str) and args:
            try:
                args = json.loads(args)
            except ValueError:
                args = None  # kept in the history, so coerced rather than refused
        parsed_calls.append({**item, "function": {**function, "arguments": _object(args)}})
    message["tool_calls"] = parsed_calls


def _object(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, Mapping) else {}


def _render(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    tools: Any,
    generation: bool,
    kwargs: Any,
) -> str:
    try:
        return template.render(
            messages,
            tools if isinstance(tools, list) else None,
            generation,
            kwargs if isinstance(kwargs, Mapping) else None,
        )
    except ChatError:
        raise
    except Exception as e:  # the template rejects the chat: both engines answer 400
        raise ChatError(f"chat template: {e}", "messages") from None


def _vllm_prompt(
    body: Mapping[str, Any], messages: list[Any], cfg: EngineConfig
) -> tuple[str, bool]:
    generation = _flag(body, "add_generation_prompt", True)
    continuing = _flag(body, "continue_final_message", False)
    if continuing and generation:  # chat_completion/protocol.py check_generation_prompt
        raise ChatError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    template = _vllm_template(body, cfg)
    msgs = [dict(m) for m in messages]
    for m in msgs:
        _vllm_tool_calls(m)
    tools, kwargs = body.get("tools"), body.get("chat_template_kwargs")
    specials = _flag(body, "add_special_tokens", False)
    if not continuing:
        return _render(template, msgs, tools, generation, kwargs), specials
    if "content" not in template.source:
        raise ChatError(
            'continue_final_message is set to "content" but this is not an accepted field in '
            "the chat_template"
        )
    final = content_text(msgs[-1].get("content"))
    msgs[-1] = {**msgs[-1], "content": final + CONTINUE_TAG}
    rendered = _render(template, msgs, tools, generation, kwargs)
    tag = CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ChatError(
            "continue_final_message is set but the final message does not appear in the "
            "chat after applying the chat template!"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        text = rendered[:at]
    else:  # the template trimmed the message's trailing space
        text = rendered[:at].rstrip()
    return text, specials


def _sglang_tool_calls(message: dict[str, Any]) -> None:
    """SGLang serving_chat.py normalize_assistant_tool_call_arguments, in place."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not isinstance(calls, list):
        return
    parsed_calls = []
    for item in calls:
        function = item.get("function") if isinstance(item, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
            try:
                args = json.loads(function["arguments"])
            except ValueError:
                raise ChatError(
                    "Assistant tool call function.arguments must be valid JSON."
                ) from None
            if not isinstance(args, dict):
                raise ChatError("Assistant tool call function.arguments must be a JSON object.")
            item = {**item, "function": {**function, "arguments": args}}
        parsed_calls.append(item)
    message["tool_calls"] = parsed_calls


def _sglang_tools(body: Mapping[str, Any]) -> list[Any] | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not isinstance(tools, list) or not tools or choice == "none":
        return None
    if isinstance(choice, Mapping):  # a named function: that tool alone
        name = (choice.get("function") or {}).get("name")
        return [t for t in tools if isinstance(t, Mapping) and _tool_name(t) == name]
    return tools


def _tool_name(tool: Mapping[str, Any]) -> Any:
    function = tool.get("function")
    return function.get("name") if isinstance(function, Mapping) else None


def _sglang_prompt(
    body: Mapping[str, Any], messages: list[Any], cfg: EngineConfig
) -> tuple[str, bool]:
    assert cfg.chat_template is not None
    msgs = []
    for message in messages:
        m = dict(message)
        _sglang_tool_calls(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("role") == "tool" and isinstance(m["content"], list):  # normalize_tool_content
            m["content"] = " ".join(
                p.get("text", "") if isinstance(p, Mapping) else str(p) for p in m["content"]
            )
        msgs.append(m)
    prefix = ""
    if msgs[-1].get("role") == "assistant" and isinstance(msgs[-1]["content"], str):
        if _flag(body, "continue_final_message", False):
            prefix = msgs.pop()["content"]
        else:  # _handle_last_assistant_message: the last message is always the user's
            msgs[-1] = {"role": "user", "content": msgs[-1]["content"]}
    kwargs = dict(body.get("chat_template_kwargs") or {})
    effort = body.get("reasoning_effort")
    if effort is not None:  # protocol.py normalize_reasoning_inputs; the request's kwargs win
        kwargs.setdefault("thinking", effort != "none")
        kwargs.setdefault("enable_thinking", effort != "none")
        kwargs.setdefault("reasoning_effort", effort)
    rendered = _render(cfg.chat_template, msgs, _sglang_tools(body), True, kwargs)
    return rendered + prefix, False
