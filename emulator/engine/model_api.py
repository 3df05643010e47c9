"""What the engines say about their model, and their tokenize endpoints, pure: the bodies of
`GET /v1/models`, SGLang's `GET /get_model_info`, vLLM's `POST /tokenize` and SGLang's
`POST /v1/tokenize` (also at `/tokenize`), and vLLM's LoRA adapter loads and unloads.
Errors are `BadRequest`s (emulator/engine/wire.py), answered in the flavor's error shape.

The model path is the twin's tokenizer directory (emulator/engine/tokenizer.py), so a router on
this machine finds the engine's tokenizer files from `root` (vLLM) or `model_path` (SGLang)
as it would a real engine's.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from typing import Any

from emulator.engine.chat import ChatError, chat_prompt
from emulator.engine.config import SGLANG, VLLM, EngineConfig
from emulator.engine.lora import LORA_NOT_ENABLED, LoraError
from emulator.engine.parse import BadRequest, InvalidBody, chat_messages, request_model
from ext_proc.prompt.tokens import APPROX


def model_path(cfg: EngineConfig) -> str:
    """The model the engine was started with (the served name when the twin has no model
    directory: the 4-bytes-per-token approximation)."""
    return cfg.model_path or cfg.model


def models_body(cfg: EngineConfig) -> dict[str, Any]:
    """GET /v1/models. vLLM (openai/models/serving.py show_available_models): a card per
    served name (root = the model path it serves), then one per loaded adapter (id = its
    name, root = its path, parent = the first served name, max_model_len null); every
    ModelPermission field (tests/fixtures/vllm/routes.json). SGLang (http_server.py
    available_models): root = the served name, which defaults to the model path
    (server_args.py); with LoRA enabled, its adapters likewise (parent the served name).
    max_model_len: the context limit the twin enforces (null: none)."""
    created = int(time.time())
    names = cfg.served_names if cfg.flavor == VLLM else (cfg.model,)
    root = model_path(cfg) if cfg.flavor == VLLM else cfg.model
    cards = [_card(cfg, name, root, None, cfg.context_length, created) for name in names]
    if cfg.enable_lora:
        for a in cfg.adapters:
            cards.append(_card(cfg, a.name, a.path, cfg.model, None, created))
    return {"object": "list", "data": cards}


def _card(
    cfg: EngineConfig, name: str, root: str, parent: str | None, ctx: int | None, created: int
) -> dict[str, Any]:
    model: dict[str, Any] = {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": cfg.flavor,
        "root": root,
        "parent": parent,
        "max_model_len": ctx,
    }
    if cfg.flavor == VLLM:
        model["permission"] = [
            {
                "id": f"modelperm-{secrets.token_hex(8)}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ]
    return model


def model_info_body(cfg: EngineConfig) -> dict[str, Any]:
    """SGLang GET /get_model_info (http_server.py): tokenizer_path defaults to the model
    path (server_args.py)."""
    return {
        "model_path": model_path(cfg),
        "tokenizer_path": model_path(cfg),
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
    }


def _ids(text: str, cfg: EngineConfig, add_special_tokens: bool) -> list[int]:
    """The ids the engine gives `text` ([] for ""; the tokenize endpoints count 0)."""
    tok = cfg.tokenizer
    encode = getattr(tok, "encode", None)
    if tok is APPROX or encode is None:
        return tok.ids(text)
    return list(encode(text, add_special_tokens))


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidBody(f"'{key}' must be a boolean, got {type(value).__name__}", key)
    return value


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise InvalidBody(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def vllm_tokenize(body: Any, cfg: EngineConfig) -> dict[str, Any]:
    """vLLM POST /tokenize (serve/tokenize/protocol.py, serving.py): a completion body
    {"prompt": str, "add_special_tokens" (default true)} or a chat body {"messages",
    "add_generation_prompt" (true), "continue_final_message" (false), "add_special_tokens"
    (false), "chat_template", "chat_template_kwargs", "tools"}, rendered as the chat
    endpoint renders it; "return_token_strs" (false) adds the vocabulary's strings."""
    body = _object(body)
    request_model(body, cfg)  # 404 for a model it does not serve
    strs = _bool(body, "return_token_strs", False)
    if "messages" in body:
        messages = chat_messages(body)
        try:
            text, specials = chat_prompt(body, messages, cfg)
        except ChatError as e:
            raise BadRequest(str(e), e.param) from None
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise InvalidBody("'prompt' must be a string (or send 'messages')", "prompt")
        text, specials = prompt, _bool(body, "add_special_tokens", True)
    ids = _ids(text, cfg, specials)
    token_strs = getattr(cfg.tokenizer, "token_strs", None)
    return {
        "count": len(ids),
        "max_model_len": cfg.context_length,
        "tokens": ids,
        "token_strs": token_strs(ids) if strs and token_strs is not None else None,
    }


def sglang_tokenize(body: Any, cfg: EngineConfig) -> dict[str, Any]:
    """SGLang POST /v1/tokenize (openai/serving_tokenize.py): "prompt" a string or a list
    of strings (ids and counts then per string), "add_special_tokens" (default true);
    max_model_len is the tokenizer's model_max_length (-1 without one)."""
    body = _object(body)
    specials = _bool(body, "add_special_tokens", True)
    prompt = body.get("prompt")
    out: dict[str, Any]
    if isinstance(prompt, str):
        ids = _ids(prompt, cfg, specials)
        out = {"tokens": ids, "count": len(ids)}
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        each = [_ids(p, cfg, specials) for p in prompt]
        out = {"tokens": each, "count": [len(ids) for ids in each]}
    else:
        raise InvalidBody("'prompt' must be a string or a list of strings", "prompt")
    out["max_model_len"] = getattr(cfg.tokenizer, "model_max_length", -1)
    return out


TOKENIZE_PATHS = {SGLANG: ("/v1/tokenize", "/tokenize"), VLLM: ("/tokenize",)}


def _lora_field(body: Mapping[str, Any], key: str) -> str:
    value = body.get(key)
    if value is None:
        raise InvalidBody(f"missing required field '{key}'", key)
    if not isinstance(value, str):
        raise InvalidBody(f"'{key}' must be a string, got {type(value).__name__}", key)
    return value


def load_lora(body: Any, cfg: EngineConfig) -> str:
    """vLLM POST /v1/load_lora_adapter (serve/lora/protocol.py LoadLoRAAdapterRequest:
    lora_name, lora_path, load_inplace): the 200 text. Raises InvalidBody, or LoraError in
    the engine's words (models/serving.py; without --enable-lora the engine refuses the
    adapter, answered as an InternalServerError)."""
    body = _object(body)
    name, path = _lora_field(body, "lora_name"), _lora_field(body, "lora_path")
    inplace = _bool(body, "load_inplace", False)
    if not cfg.enable_lora and name and path:
        raise LoraError(500, LORA_NOT_ENABLED, "InternalServerError")
    cfg.adapters.load(name, path, inplace)
    return f"Success: LoRA adapter '{name}' added successfully."


def unload_lora(body: Any, cfg: EngineConfig) -> str:
    """vLLM POST /v1/unload_lora_adapter (UnloadLoRAAdapterRequest: lora_name)."""
    name = _lora_field(_object(body), "lora_name")
    cfg.adapters.unload(name)
    return f"Success: LoRA adapter '{name}' removed successfully."
