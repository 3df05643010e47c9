"""A chat rendered into one prompt string the way the engine renders it: the model's Jinja
chat template, evaluated as Hugging Face transformers evaluates it.

vLLM renders a chat request with the tokenizer's `apply_chat_template`
(vllm/renderers/hf.py `safe_apply_chat_template`; vllm/entrypoints/chat_utils.py in older
releases), which compiles the template in transformers'
utils/chat_template_utils.py `_compile_jinja_template`: a sandboxed, immutable Jinja
environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a
`tojson` filter that does not escape HTML, and the globals `raise_exception` and
`strftime_now`. The template sees `messages`, `tools`, `add_generation_prompt` (a chat
request's default: true), the tokenizer's special tokens (`bos_token`, `eos_token`, ...)
and the request's `chat_template_kwargs`. Message content reaches the template as vLLM's
"string" content format gives it: a string; a list of parts is its text parts joined by
newlines; no content is "". The rendered text is then tokenized without adding special
tokens (the template wrote them).

The template comes from a Jinja file or from a `tokenizer_config.json` that carries
`chat_template` (a string, or a list of named templates of which `default` is used).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The special tokens transformers hands a template (its special_tokens_map).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")
TOKENIZER_CONFIG = "tokenizer_config.json"


class ChatTemplateError(ValueError):
    """A template file cannot be read or compiled."""


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant spans with
    it for training masks): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def content_text(content: Any) -> str:
    """A message's content as vLLM's "string" content format gives it to a template."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"]
            for part in content
            if isinstance(part, Mapping)
            and part.get("type", "text") == "text"
            and isinstance(part.get("text"), str)
        )
    return ""


class ChatTemplate:
    """One compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"not a valid Jinja template: {e} (line {e.lineno})") from e
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt for `messages` (OpenAI chat messages). Raises what the template
        raises (`raise_exception` gives jinja2's TemplateError), and ChatTemplateError
        when the final message to continue does not appear in the rendering."""
        context: dict[str, Any] = {**self.special_tokens, **(template_kwargs or {})}
        rendered = [_template_message(m) for m in messages]
        if continue_final_message and rendered:
            # As transformers' apply_chat_template (utils/chat_template_utils.py): mark
            # the end of the final message's text, render, and cut there.
            rendered[-1]["content"] += _CONTINUE_TAG
        context["messages"] = rendered
        context["tools"] = list(tools) if tools is not None else None
        context["documents"] = None
        context["add_generation_prompt"] = add_generation_prompt
        text = self._template.render(context)
        if not (continue_final_message and rendered):
            return text
        at = text.rfind(_CONTINUE_TAG.strip())
        if at < 0:
            raise ChatTemplateError("continue_final_message: the template drops the final message")
        return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()


# transformers' marker for the end of a message to continue (chat_template_utils.py).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tool_arguments(value: Any) -> dict[str, Any]:
    """A tool call's arguments as templates read them: vLLM parses a JSON string to an
    object and makes anything else (empty, malformed, not an object) {}
    (vllm/renderers/chat_utils.py _postprocess_messages)."""
    if isinstance(value, str) and value:
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return {}
    return value if isinstance(value, dict) else {}


def _template_message(m: Mapping[str, Any]) -> dict[str, Any]:
    """One message as the engine hands it to the template: its content as text, and an
    assistant's tool calls with their arguments parsed (an empty list dropped)."""
    out = {**m, "content": content_text(m.get("content"))}
    calls = m.get("tool_calls")
    if m.get("role") == "assistant" and isinstance(calls, list):
        if not calls:
            out.pop("tool_calls")
        else:
            out["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": _tool_arguments(c["function"].get("arguments")),
                    },
                }
                if isinstance(c, Mapping) and isinstance(c.get("function"), Mapping)
                else c
                for c in calls
            ]
    return out


def _token_text(value: Any) -> str | None:
    """A special token in a tokenizer_config.json: a string, or a serialized AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ChatTemplateError(f"cannot read {path}: {e.strerror}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"{path} is not valid JSON: {e}") from e


def special_tokens_of(tokenizer_config: Path) -> dict[str, str]:
    """bos_token, eos_token, ... of a tokenizer_config.json ({} when it has none)."""
    doc = _read_json(tokenizer_config)
    if not isinstance(doc, Mapping):
        return {}
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        text = _token_text(doc.get(key))
        if text is not None:
            out[key] = text
    return out


def template_in_config(tokenizer_config: Path) -> str | None:
    """The `chat_template` a tokenizer_config.json carries (None: it has none)."""
    doc = _read_json(tokenizer_config)
    value = doc.get("chat_template") if isinstance(doc, Mapping) else None
    if isinstance(value, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        value = named.get("default")
    return value if isinstance(value, str) and value else None


def load_chat_template(path: Path, tokenizer_config: Path | None = None) -> ChatTemplate:
    """The template in `path`: a tokenizer_config.json with `chat_template` (its special
    tokens too), or a Jinja file (special tokens from `tokenizer_config` when given)."""
    if not path.is_file():
        raise ChatTemplateError(f"no such file {path}")
    if path.suffix == ".json":
        source = template_in_config(path)
        if source is None:
            raise ChatTemplateError(f"{path} has no chat_template")
        specials = special_tokens_of(path)
    else:
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"cannot read {path}: {e}") from e
        specials = special_tokens_of(tokenizer_config) if tokenizer_config else {}
    try:
        return ChatTemplate(source, specials)
    except ChatTemplateError as e:
        raise ChatTemplateError(f"{path}: {e}") from e
