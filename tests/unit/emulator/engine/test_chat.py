"""Each flavor renders a chat request as its engine does (emulator/engine/chat.py): the request's
template options (vLLM), the last assistant message (SGLang), tool-call arguments, and
whether special tokens are added when the text is encoded. Pure: the tiny model's ChatML
template and a template that prints what it is given."""

from __future__ import annotations

from typing import Any

import pytest

from emulator.engine.chat import UNTRUSTED_TEMPLATE, ChatError, chat_prompt
from emulator.engine.config import SGLANG, VLLM, EngineConfig
from emulator.vllm.tiny_model import CHAT_TEMPLATE
from ext_proc.prompt.chat_template import ChatTemplate
from ext_proc.prompt.tokens import render_chat

CHATML = ChatTemplate(CHAT_TEMPLATE, {"eos_token": "<|im_end|>"})
# Prints each message's role, content and tool calls' arguments as the template sees them.
SHOW = ChatTemplate(
    "{% for m in messages %}[{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %} {{ c.function.arguments | tojson }}{% endfor %}]"
    "{% endfor %}{% if tools %}tools={{ tools | length }}{% endif %}"
    "{% if add_generation_prompt %}<gen>{% endif %}{{ extra | default('') }}"
    "{% if enable_thinking is defined %} thinking={{ enable_thinking }}{% endif %}"
)
USER = [{"role": "user", "content": "hi"}]
PREFILL = [*USER, {"role": "assistant", "content": "Sure, "}]


def cfg(flavor: str, template: ChatTemplate = CHATML, **extra: Any) -> EngineConfig:
    return EngineConfig(name="e", flavor=flavor, chat_template=template, **extra)


def call(content: str | dict[str, Any] | None, call_type: str = "function") -> dict[str, Any]:
    return {"id": "c1", "type": call_type, "function": {"name": "f", "arguments": content}}


# -- vLLM ----------------------------------------------------------------------------------


def test_vllm_renders_the_chatml_prompt_and_adds_no_special_tokens_by_default() -> None:
    text, specials = chat_prompt({}, USER, cfg(VLLM))
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert specials is False
    assert chat_prompt({"add_special_tokens": True}, USER, cfg(VLLM))[1] is True
    no_gen, _ = chat_prompt({"add_generation_prompt": False}, USER, cfg(VLLM))
    assert no_gen == "<|im_start|>user\nhi<|im_end|>\n"


def test_vllm_continues_the_final_message_open_ended() -> None:
    """transformers marks the message's end, renders, and cuts there: no <|im_end|>."""
    body = {"continue_final_message": True, "add_generation_prompt": False}
    text, _ = chat_prompt(body, PREFILL, cfg(VLLM))
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nSure, "
    # a template that strips the content's trailing space: the cut drops it too
    strip = ChatTemplate("{% for m in messages %}<{{ m.content | trim }}>{% endfor %}")
    assert chat_prompt(body, PREFILL, cfg(VLLM, strip))[0] == "<hi><Sure,"


def test_vllm_refuses_continue_with_a_generation_prompt() -> None:
    with pytest.raises(ChatError, match="Cannot set both `continue_final_message`"):
        chat_prompt({"continue_final_message": True}, PREFILL, cfg(VLLM))


def test_vllm_takes_a_request_template_only_when_trusted() -> None:
    body = {"chat_template": "{% for m in messages %}{{ m.content }}|{% endfor %}"}
    with pytest.raises(ChatError) as e:
        chat_prompt(body, USER, cfg(VLLM))
    assert str(e.value) == UNTRUSTED_TEMPLATE
    with pytest.raises(ChatError, match="trust-request-chat-template"):
        chat_prompt({"chat_template_kwargs": {"chat_template": "x"}}, USER, cfg(VLLM))
    assert chat_prompt(body, USER, cfg(VLLM, trust_request_chat_template=True))[0] == "hi|"


def test_vllm_parses_tool_call_arguments_to_objects() -> None:
    """renderers/chat_utils.py _postprocess_messages: a JSON string becomes an object; a
    malformed or non-object one {} (kept in the history, so not refused); none, {}."""
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call('{"city": "Ashburn"}'), call("{oops"), call("[1]"), call(None)],
        },
    ]
    text, _ = chat_prompt({}, messages, cfg(VLLM, SHOW))
    assert text == '[user:hi][assistant: {"city": "Ashburn"} {} {} {}]<gen>'
    # an empty list takes the template's plain assistant path; a non-function call is refused
    empty = [*USER, {"role": "assistant", "content": "x", "tool_calls": []}]
    assert chat_prompt({}, empty, cfg(VLLM, SHOW))[0] == "[user:hi][assistant:x]<gen>"
    bad = [*USER, {"role": "assistant", "content": "", "tool_calls": [call("{}", "web")]}]
    with pytest.raises(ChatError, match="of type 'function'") as e:
        chat_prompt({}, bad, cfg(VLLM, SHOW))
    assert e.value.param == "tool_calls"


def test_vllm_passes_tools_and_template_kwargs() -> None:
    body = {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}
    assert chat_prompt(body, USER, cfg(VLLM, SHOW))[0] == "[user:hi]tools=1<gen>"
    kwargs = {"chat_template_kwargs": {"extra": "!"}}
    assert chat_prompt(kwargs, USER, cfg(VLLM, SHOW))[0] == "[user:hi]<gen>!"


# -- SGLang --------------------------------------------------------------------------------


def test_sglang_always_adds_the_generation_prompt_and_no_special_tokens() -> None:
    """serving_chat.py renders with add_generation_prompt=True (its request has no such
    field) and encodes without special tokens."""
    body = {"add_generation_prompt": False, "add_special_tokens": True}
    text, specials = chat_prompt(body, USER, cfg(SGLANG))
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert specials is False


def test_sglang_continues_or_hands_the_last_assistant_message_to_the_user() -> None:
    """_handle_last_assistant_message: continued, its text follows the generation prompt;
    otherwise it is sent as a user message."""
    continued, _ = chat_prompt({"continue_final_message": True}, PREFILL, cfg(SGLANG))
    assert continued == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nSure, "
    as_user, _ = chat_prompt({}, PREFILL, cfg(SGLANG))
    assert as_user == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>user\nSure, <|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_sglang_tool_call_arguments_must_be_json_objects() -> None:
    calls = [call('{"n": 1}')]
    last = [*USER, {"role": "assistant", "content": None, "tool_calls": calls}]
    # content None is "": continued, nothing follows; else handed to the user without calls
    assert chat_prompt({"continue_final_message": True}, last, cfg(SGLANG, SHOW))[0] == (
        "[user:hi]<gen>"
    )
    assert chat_prompt({}, last, cfg(SGLANG, SHOW))[0] == "[user:hi][user:]<gen>"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    turns = [*USER, {**last[-1], "content": "x"}, {"role": "tool", "content": parts}]
    text, _ = chat_prompt({}, turns, cfg(SGLANG, SHOW))
    assert text == '[user:hi][assistant:x {"n": 1}][tool:a b]<gen>'  # tool parts joined by " "
    for args, problem in (("{oops", "valid JSON"), ("[1]", "a JSON object")):
        bad = [*USER, {"role": "assistant", "content": "", "tool_calls": [call(args)]}]
        with pytest.raises(ChatError, match=problem):
            chat_prompt({}, bad, cfg(SGLANG, SHOW))


def test_sglang_tools_follow_tool_choice_and_reasoning_effort_sets_thinking() -> None:
    tools = [{"type": "function", "function": {"name": n}} for n in ("f", "g")]
    assert chat_prompt({"tools": tools}, USER, cfg(SGLANG, SHOW))[0] == "[user:hi]tools=2<gen>"
    none = {"tools": tools, "tool_choice": "none"}
    assert chat_prompt(none, USER, cfg(SGLANG, SHOW))[0] == "[user:hi]<gen>"
    named = {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "g"}}}
    assert chat_prompt(named, USER, cfg(SGLANG, SHOW))[0] == "[user:hi]tools=1<gen>"
    effort = {"reasoning_effort": "none"}
    assert chat_prompt(effort, USER, cfg(SGLANG, SHOW))[0] == "[user:hi]<gen> thinking=False"


def test_without_a_template_both_flavors_use_the_plain_rendering() -> None:
    for flavor in (SGLANG, VLLM):
        plain = EngineConfig(name="e", flavor=flavor)
        assert chat_prompt({"continue_final_message": True}, PREFILL, plain) == (
            render_chat(PREFILL),
            False,
        )


def test_a_template_error_is_a_chat_error_naming_messages() -> None:
    failing = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    for flavor in (SGLANG, VLLM):
        with pytest.raises(ChatError, match="roles must alternate") as e:
            chat_prompt({}, USER, cfg(flavor, failing))
        assert e.value.param == "messages"
