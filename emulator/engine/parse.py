"""The engine's request bodies, pure (no HTTP server): OpenAI /v1/chat/completions and
/v1/completions and SGLang /generate bodies parsed into a `GenRequest` (bad input ->
`BadRequest`, always answered with HTTP 400 naming the bad field, 404 for a model vLLM does
not serve), the prompt tokenized as the engine tokenizes it (emulator/engine/chat.py renders a
chat) and checked against the context length. emulator/engine/wire.py writes the responses.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from emulator.engine.chat import ChatError, chat_prompt
from emulator.engine.config import SGLANG, VLLM, EngineConfig
from emulator.engine.lora import LoraAdapter, namespaced_blocks
from ext_proc.prompt.tokens import APPROX, block_hashes_of_ids

Kind = Literal["chat", "completion", "generate"]


class BadRequest(Exception):
    """Invalid request; `message` names what is wrong, `param` the field (vLLM says which),
    `err_type` the error type the engines write. Answered with HTTP 400."""

    status = 400
    err_type = "BadRequestError"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidBody(BadRequest):
    """A body that does not fit the request schema (not JSON, a missing field, a wrong
    type). Both engines answer it from their RequestValidationError handler with type "Bad
    Request" (SGLang http_server.py; vLLM serve/exception_handling/handlers/validation.py),
    vLLM naming the field as "body.<loc>" (tests/fixtures/vllm/errors.json)."""

    err_type = "Bad Request"

    def __init__(self, message: str, loc: str = "") -> None:
        # pydantic's loc: messages[0].role -> body.messages.0.role
        dotted = loc.replace("[", ".").replace("]", "")
        super().__init__(message, f"body.{dotted}" if dotted else "body")


@dataclass(frozen=True)
class GenRequest:
    """A validated generation request, independent of the wire format it came in."""

    kind: Kind
    input_tokens: int
    output_tokens: int
    stream: bool
    include_usage: bool
    model: str
    # Chained hashes of the prompt's full cache blocks (what the prefix cache matches).
    blocks: tuple[int, ...] = ()
    # The prompt's token ids, when the engine publishes KV events (they carry them).
    token_ids: tuple[int, ...] = ()
    # The LoRA adapter the request runs (None: the base model); `blocks` are then in the
    # adapter's namespace (emulator/engine/lora.py namespaced_blocks).
    adapter: LoraAdapter | None = None
    # The body's `priority` (None: none given). Used only when the engine's priority
    # scheduling is on (EngineConfig.priority); both engines accept it either way.
    priority: int | None = None


Prompt = tuple[int, tuple[int, ...], tuple[int, ...]]  # tokens, block hashes, token ids


def _text_prompt(
    text: str, cfg: EngineConfig, field: str, add_special_tokens: bool = False
) -> Prompt:
    tok = cfg.tokenizer
    if tok is not APPROX:  # a real tokenizer: encode once, count and hash its ids
        encode = getattr(tok, "encode", None)  # TwinTokenizer: special tokens on request
        all_ids = encode(text, add_special_tokens) if encode is not None else tok.ids(text)
        if not all_ids:
            raise BadRequest(f"'{field}' is empty: a prompt needs at least one token")
        blocks = block_hashes_of_ids(all_ids, cfg.profile.block_tokens)
        return len(all_ids), tuple(blocks), tuple(all_ids) if cfg.kv_events is not None else ()
    n = tok.count(text)
    if n == 0:
        raise BadRequest(f"'{field}' is empty: a prompt needs at least one token")
    # Token ids only when KV events must carry them (a 128k prompt is 128k ints).
    ids = tuple(tok.ids(text)) if cfg.kv_events is not None else ()
    return n, tuple(tok.block_hashes(text, cfg.profile.block_tokens)), ids


def _ids_prompt(ids: list[int], cfg: EngineConfig) -> Prompt:
    return len(ids), tuple(block_hashes_of_ids(ids, cfg.profile.block_tokens)), tuple(ids)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _opt_bool(body: Mapping[str, Any], key: str, where: str = "") -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidBody(
            f"'{where}{key}' must be a boolean, got {type(value).__name__}", where + key
        )
    return value


def _opt_int(body: Mapping[str, Any], key: str, minimum: int, where: str = "") -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value):
        raise InvalidBody(
            f"'{where}{key}' must be an integer, got {type(value).__name__}", where + key
        )
    if value < minimum:
        raise BadRequest(f"'{where}{key}' must be >= {minimum}, got {value}", where + key)
    return int(value)


class UnknownModel(BadRequest):
    """vLLM answers a request for a model it does not serve with 404 (SGLang accepts any
    name and echoes it)."""

    status = 404
    err_type = "NotFoundError"


def request_model(body: Mapping[str, Any], cfg: EngineConfig) -> str:
    """The model name a response gives (raises UnknownModel for one vLLM does not serve)."""
    return request_target(body, cfg)[0]


def request_target(body: Mapping[str, Any], cfg: EngineConfig) -> tuple[str, LoraAdapter | None]:
    """The model a request names: the name its response gives and the adapter it runs.
    vLLM (entrypoints/openai/engine/serving.py _check_model, _maybe_get_adapters;
    models/serving.py model_name): no model or any served name is the base model, named
    by the first served name; a loaded adapter's name is that adapter, named by itself;
    anything else is 404. SGLang echoes whatever it is given and runs the base model."""
    value = body.get("model")
    if value is None:
        return (cfg.model if cfg.flavor == VLLM else "default"), None
    if not isinstance(value, str):
        raise InvalidBody(f"'model' must be a string, got {type(value).__name__}", "model")
    if cfg.flavor != VLLM:
        return value, None
    if value in cfg.served_names:
        return cfg.model, None
    adapter = cfg.adapters.get(value)
    if adapter is not None:
        return adapter.name, adapter
    # The real one's words (tests/fixtures/vllm/errors.json): the served names.
    raise UnknownModel(
        f"The model `{value}` does not exist. Valid aliases: {', '.join(cfg.served_names)}.",
        "model",
    )


Common = tuple[int, bool, bool, str, LoraAdapter | None]


def _openai_common(body: Mapping[str, Any], cfg: EngineConfig) -> Common:
    """max tokens, stream, include_usage, model and adapter of an OpenAI-style body."""
    max_tokens = _opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    if max_tokens is None:
        max_tokens = cfg.default_max_tokens
    stream = _opt_bool(body, "stream")
    options = body.get("stream_options")
    include_usage = cfg.default_include_usage
    if options is not None:
        if not isinstance(options, Mapping):
            raise InvalidBody(
                f"'stream_options' must be an object, got {type(options).__name__}",
                "stream_options",
            )
        asked = _opt_bool(options, "include_usage", "stream_options.")
        if cfg.flavor == VLLM and "include_usage" not in options:
            asked = True  # vLLM's StreamOptions.include_usage defaults to true
        include_usage = asked or include_usage
    model, adapter = request_target(body, cfg)
    return max_tokens, stream, include_usage, model, adapter


def _token_ids(value: list[Any], field: str) -> list[int]:
    """A list of token ids counts one token per id."""
    if not all(_is_int(t) for t in value):
        raise InvalidBody(f"'{field}' must be a list of integer token ids", field)
    return value


def parse_chat(body: Any, cfg: EngineConfig) -> GenRequest:
    """Validate a /v1/chat/completions body; input tokens = tokens of the rendered chat."""
    if not isinstance(body, Mapping):
        raise InvalidBody(f"request body must be a JSON object, got {type(body).__name__}")
    messages = chat_messages(body)
    max_tokens, stream, include_usage, model, adapter = _openai_common(body, cfg)
    try:
        text, specials = chat_prompt(body, messages, cfg)
    except ChatError as e:
        raise BadRequest(str(e), e.param) from None
    input_tokens, blocks, ids = _text_prompt(text, cfg, "messages", specials)
    return _with_adapter(
        GenRequest("chat", input_tokens, max_tokens, stream, include_usage, model, blocks, ids),
        adapter,
    )


def _with_adapter(req: GenRequest, adapter: LoraAdapter | None) -> GenRequest:
    if adapter is None:
        return req
    return replace(req, adapter=adapter, blocks=namespaced_blocks(req.blocks, adapter.name))


def chat_messages(body: Mapping[str, Any]) -> list[Any]:
    """A chat body's `messages`, checked as the engines' schemas check them."""
    messages = body.get("messages")
    if messages is None:
        raise InvalidBody("missing required field 'messages'", "messages")
    if not isinstance(messages, list):
        raise InvalidBody("'messages' must be a non-empty list of message objects", "messages")
    if not messages:
        raise BadRequest("'messages' must be a non-empty list of message objects", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidBody(
                f"'messages[{i}]' must be an object, got {type(message).__name__}",
                f"messages[{i}]",
            )
        if not isinstance(message.get("role"), str):
            raise InvalidBody(f"'messages[{i}].role' must be a string", f"messages[{i}].role")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise InvalidBody(
                f"'messages[{i}].content' must be a string, a list of parts or null, "
                f"got {type(content).__name__}",
                f"messages[{i}].content",
            )
    return messages


def completion_special_tokens(body: Mapping[str, Any], cfg: EngineConfig) -> bool:
    """Whether a text prompt gets the tokenizer's special tokens (a BOS): vLLM's
    CompletionRequest.add_special_tokens, default true (completion/protocol.py); SGLang
    encodes text with the tokenizer's default, true (managers/tokenizer_manager.py)."""
    if cfg.flavor == SGLANG:
        return True
    value = body.get("add_special_tokens")
    if value is None:
        return True
    if not isinstance(value, bool):
        raise InvalidBody(
            f"'add_special_tokens' must be a boolean, got {type(value).__name__}",
            "add_special_tokens",
        )
    return value


def parse_completion(body: Any, cfg: EngineConfig) -> GenRequest:
    """Validate a /v1/completions body. `prompt` is a string, a list of strings (counted as
    their concatenation: the emulator answers one choice), or a list of token ids."""
    if not isinstance(body, Mapping):
        raise InvalidBody(f"request body must be a JSON object, got {type(body).__name__}")
    prompt = body.get("prompt")
    if prompt is None:
        raise InvalidBody("missing required field 'prompt'", "prompt")
    specials = completion_special_tokens(body, cfg)
    if isinstance(prompt, str):
        input_tokens, blocks, ids = _text_prompt(prompt, cfg, "prompt", specials)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        input_tokens, blocks, ids = _text_prompt("".join(prompt), cfg, "prompt", specials)
    elif isinstance(prompt, list) and prompt:
        input_tokens, blocks, ids = _ids_prompt(_token_ids(prompt, "prompt"), cfg)
    else:
        raise InvalidBody(
            "'prompt' must be a string, a non-empty list of strings or a list of token ids",
            "prompt",
        )
    max_tokens, stream, include_usage, model, adapter = _openai_common(body, cfg)
    req = GenRequest(
        "completion", input_tokens, max_tokens, stream, include_usage, model, blocks, ids
    )
    return _with_adapter(req, adapter)


def parse_generate(body: Any, cfg: EngineConfig) -> GenRequest:
    """Validate a native SGLang /generate body: `text` (or `input_ids`), `sampling_params`,
    `stream`. max_new_tokens may be 0 (prefill only, as SGLang allows)."""
    # Schema errors are answered by SGLang's validation handler (a flat ErrorResponse);
    # the rest are ValueErrors inside /generate: {"error": {"message"}} (http_server.py).
    if not isinstance(body, Mapping):
        raise InvalidBody(f"request body must be a JSON object, got {type(body).__name__}")
    text = body.get("text")
    input_ids = body.get("input_ids")
    if text is not None:
        if not isinstance(text, str):
            raise InvalidBody(f"'text' must be a string, got {type(text).__name__}", "text")
        # tokenizer_manager.py encodes the text with the tokenizer's special tokens
        input_tokens, blocks, ids = _text_prompt(text, cfg, "text", True)
    elif input_ids is not None:
        if not isinstance(input_ids, list) or not input_ids:
            raise InvalidBody(
                "'input_ids' must be a non-empty list of integer token ids", "input_ids"
            )
        input_tokens, blocks, ids = _ids_prompt(_token_ids(input_ids, "input_ids"), cfg)
    else:
        raise BadRequest("missing required field 'text'")
    params = body.get("sampling_params")
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise InvalidBody(
            f"'sampling_params' must be an object, got {type(params).__name__}",
            "sampling_params",
        )
    # sampling_params is a free dict to the schema: SGLang checks its values itself
    # (SamplingParams.verify, a ValueError).
    try:
        max_new_tokens = _opt_int(params, "max_new_tokens", 0, "sampling_params.")
    except InvalidBody as exc:
        raise BadRequest(exc.message) from None
    if max_new_tokens is None:
        max_new_tokens = cfg.default_max_tokens
    return GenRequest(
        kind="generate",
        input_tokens=input_tokens,
        output_tokens=max_new_tokens,
        stream=_opt_bool(body, "stream"),
        include_usage=False,
        model=cfg.model,
        blocks=blocks,
        token_ids=ids,
    )


def decode_json(raw: bytes) -> Any:
    """A request body's JSON value; not JSON at all -> InvalidBody."""
    try:
        return json.loads(raw)
    except ValueError as exc:  # includes bad UTF-8
        pos = getattr(exc, "pos", getattr(exc, "start", 0))
        raise _json_invalid(pos, getattr(exc, "msg", None) or str(exc)) from None
    except RecursionError:
        raise _json_invalid(0, "nested too deeply") from None


def _json_invalid(pos: int, reason: str) -> InvalidBody:
    """pydantic's json_invalid error, at loc body.<offset>, in the real vLLM's words
    (tests/fixtures/vllm/errors.json; SGLang's handler prints the same pydantic error)."""
    return InvalidBody(
        "1 validation error:\n  {'type': 'json_invalid', "
        f"'loc': 'body.{pos}', 'msg': 'JSON decode error', 'input': '<dict of 0 items>', "
        f"'ctx': {{'error': '{reason}'}}}}",
        str(pos),
    )


def parse_request(kind: Kind, raw: bytes, cfg: EngineConfig) -> GenRequest:
    """Validate the raw body of a request for endpoint `kind`."""
    body = decode_json(raw)
    try:
        if kind == "chat":
            req = parse_chat(body, cfg)
        elif kind == "completion":
            req = parse_completion(body, cfg)
        else:
            req = parse_generate(body, cfg)
    except (UnicodeEncodeError, TypeError) as e:
        # A lone surrogate ("\ud800") is valid JSON, but text the tokenizers library cannot
        # take (a TypeError from its Rust binding): vLLM's handler answers such errors 400
        # (serving_chat.py create_chat_completion catches ValueError and TypeError), SGLang's
        # too (tokenizer_manager's errors reach serving_base.py as a 400).
        raise BadRequest(str(e)) from None
    req = replace(req, priority=request_priority(body))
    # the engines check the limit asked for against the context; the twin then caps what
    # it generates (max_tokens_cap)
    req = _check_context(req, cfg)
    return replace(req, output_tokens=min(req.output_tokens, cfg.max_tokens_cap))


# vLLM's protocol bounds `priority` to a signed 64-bit integer (chat_completion/protocol.py
# Field(ge=_INT64_MIN, le=_INT64_MAX)).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def request_priority(body: Mapping[str, Any]) -> int | None:
    """The body's `priority`: vLLM's chat and completions requests (an int, default 0;
    chat_completion/protocol.py, completion/protocol.py), SGLang's OpenAI requests and
    /generate (Optional[int]; openai_api/protocol.py, io_struct.py GenerateReqInput). A
    value that is not an integer is a schema error (400, as measured on vLLM 0.32:
    int_parsing at body.priority)."""
    value = body.get("priority")
    if value is None:
        return None
    if not _is_int(value):
        raise InvalidBody(f"'priority' must be an integer, got {type(value).__name__}", "priority")
    if not INT64_MIN <= value <= INT64_MAX:
        raise InvalidBody(f"'priority' must be a 64-bit integer, got {value}", "priority")
    return int(value)


def _check_context(req: GenRequest, cfg: EngineConfig) -> GenRequest:
    """The context-length checks, in each engine's words (SGLang tokenizer_manager.py
    _validate_one_request; vLLM 0.32 as measured here, tests/fixtures/vllm/errors.json).
    Returns the request, its output shortened where the engine does that."""
    ctx, n, m = cfg.context_length, req.input_tokens, req.output_tokens
    if ctx is None:
        return req
    if cfg.flavor == SGLANG:
        if n >= ctx:
            raise BadRequest(
                f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens)."
            )
        if n + m > ctx:
            raise BadRequest(
                "Requested token count exceeds the model's maximum context length of "
                f"{ctx} tokens. You requested a total of {n + m} tokens: {n} tokens from the "
                f"input messages and {m} tokens for the completion. Please reduce the number "
                "of tokens in the input messages or the completion to fit within the limit."
            )
        return req
    # vLLM 0.32: a limit above the whole context is refused; a prompt that leaves no room
    # is refused (it tokenizes at most ctx + 1 tokens, hence "at least"); otherwise a limit
    # that does not fit is shortened to what does (200, finish_reason length).
    if m > ctx:
        raise BadRequest(
            f"max_tokens={m} cannot be greater than max_model_len={ctx}. Please request "
            f"fewer output tokens. (parameter=max_tokens, value={m})",
            "max_tokens",
        )
    if n >= ctx:
        seen = min(n, ctx + 1)
        raise BadRequest(
            f"This model's maximum context length is {ctx} tokens. However, your prompt "
            f"contains at least {seen} input tokens, which exceeds this limit even without "
            f"any output tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={seen})",
            "input_tokens",
        )
    if n + m > ctx:
        return replace(req, output_tokens=ctx - n)
    return req
