"""The admission step before a decision: requests the router answers itself, no engine
reached. By the request's `model`, against what the backends serve (their engines'
/v1/models, or config): a model no backend serves (404), no model named when the fleet
serves several (400), a model whose every backend is out of rotation (503), a prompt longer
than every such backend's context (400); and, with shedding on, every queue past its
bound (429). The answers are those of the vLLM
production-stack router (src/vllm_router/services/request_service/request.py) and
OpenAI's API. And where a request the policy does not route may go (`fallback_order`).
Pure.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from dataclasses import replace

from ext_proc.config.schema import ModelAlias
from ext_proc.core.backend import BackendState
from ext_proc.core.state import FleetState
from ext_proc.vocab.backend import EngineKind
from ext_proc.vocab.errors import (
    CONTEXT_LENGTH,
    MODEL_NOT_FOUND,
    MODEL_REQUIRED,
    PROMPT_PARAM,
    UNAVAILABLE,
)
from ext_proc.vocab.request import LlmRequest
from ext_proc.vocab.types import BackendLifecycle, Refusal

# Retry-After of a model whose backends are all draining or pending (none comes back by
# itself on a timer): about a probe round and a models read.
UNAVAILABLE_RETRY_S = 5.0


def served_name(aliases: Sequence[ModelAlias], model: str | None, key: str) -> str | None:
    """The served name a request for `model` goes as: an alias's share picked by a hash
    of `key` (the session's, so a conversation stays on one version and its cache; else the
    request id's), or `model` itself when it is no alias."""
    alias = next((a for a in aliases if a.name == model), None)
    if alias is None:
        return model
    total = sum(s.weight for s in alias.served)
    point = zlib.crc32(f"model:{key}".encode()) / 2**32 * total
    for share in alias.served:
        point -= share.weight
        if point < 0:
            return share.model
    return alias.served[-1].model


def serving(state: FleetState, model: str | None) -> list[BackendState]:
    """The backends (any lifecycle) a request for `model` may go to: those serving it
    (or whose models are not known). A name no backend lists goes, when the fleet serves
    a single base model, to its SGLang backends: SGLang answers any name with its model
    (sglang/srt/entrypoints/openai/serving_chat.py ignores it unless it names a LoRA
    adapter), so clients that send a placeholder keep working; vLLM answers such a name
    404 (serving_engine.py `_check_model`), as the router then does."""
    backends = state.backends.values()
    if model is None:
        return list(backends)
    unknown = [b for b in backends if b.models is None]
    listing = [b for b in backends if (m := b.models) is not None and m.serves(model)]
    if listing:
        return listing + unknown
    if len(_base_names(backends)) > 1:
        return unknown
    return [b for b in backends if b.models is None or b.config.engine is EngineKind.SGLANG]


def _base_names(backends: Iterable[BackendState]) -> set[str]:
    """The base models the backends whose models are known serve."""
    return {name for b in backends if (m := b.models) is not None for name in m.base}


def model_refusal(state: FleetState, model: str | None, now_s: float) -> Refusal | None:
    """None: the request may go on (some backend may serve it)."""
    if model is None:
        bases = _base_names(state.backends.values())
        if len(bases) > 1:
            listed = ", ".join(sorted(bases))
            return Refusal(
                MODEL_REQUIRED,
                f"you must provide a model parameter (this endpoint serves {listed})",
            )
        return None
    candidates = serving(state, model)
    if not state.backends:  # none at all (a discovered pool emptied): nothing is known
        return Refusal(UNAVAILABLE, "no backend in the fleet, retry later", UNAVAILABLE_RETRY_S)
    if not candidates:
        return Refusal(
            MODEL_NOT_FOUND,
            f"Model '{model}' not found. Available models can be listed at /v1/models.",
        )
    active = [b for b in candidates if b.lifecycle is BackendLifecycle.ACTIVE]
    if any(not b.health.ejected_at(now_s) for b in active):
        return None
    waits = [
        b.health.ejected_until_s - now_s for b in active if b.health.ejected_until_s is not None
    ]
    return Refusal(
        UNAVAILABLE,
        f"model '{model}': every backend serving it is ejected or draining, retry later",
        min(waits) if waits else UNAVAILABLE_RETRY_S,
    )


# Without the engine's tokenizer the router counts ~4 bytes a token, which can be off
# either way by about this factor (code, other scripts): a prompt so counted is taken as
# too long for a context only beyond it.
APPROX_TOKENS_FACTOR = 2.0


def fits_context(b: BackendState, llm: LlmRequest | None) -> bool:
    """Whether the request's prompt fits the context its backend's engine reports
    (`max_model_len` on /v1/models; unknown: it may). Both engines refuse a prompt of the
    whole context or more (vLLM's and SGLang's 400, docs/engine-model.md)."""
    served = b.models
    limit = served.max_model_len if served is not None else None
    if llm is None or limit is None:
        return True
    exact = all(isinstance(p, tuple) for p in llm.prompts)
    tokens = llm.input_tokens if exact else llm.input_tokens / APPROX_TOKENS_FACTOR
    return tokens < limit


def context_refusal(state: FleetState, llm: LlmRequest | None) -> Refusal | None:
    """400 when no backend that may serve the request can hold its prompt: answered here
    instead of by an engine after a trip, and never counted as that engine's cache."""
    model = llm.model if llm is not None else None
    backends = [b for b in serving(state, model) if b.lifecycle is BackendLifecycle.ACTIVE]
    if llm is None or not backends or any(fits_context(b, llm) for b in backends):
        return None
    longest = max(b.models.max_model_len or 0 for b in backends if b.models is not None)
    return Refusal(
        replace(CONTEXT_LENGTH, param=PROMPT_PARAM.get(llm.api)),
        f"the prompt ({llm.input_tokens} tokens) is longer than the context of every "
        f"backend that serves {model or 'this request'} (at most {longest} tokens)",
    )


def fleet_models(
    state: FleetState, aliases: Sequence[ModelAlias] = ()
) -> dict[str, str | None] | None:
    """Every model name some active backend serves, each with its parent (a LoRA
    adapter's base model; None for a base model): the fleet's /v1/models. A backend
    whose models are not known (its engine has not answered) adds none until it does:
    the others' are still the fleet's (one engine's list, the fallback, would hide
    theirs); with the `aliases` whose served names it serves. None while no active
    backend's models are known."""
    out: dict[str, str | None] = {}
    known = False
    for b in state.backends.values():
        served = b.models
        if b.lifecycle is not BackendLifecycle.ACTIVE or served is None:
            continue
        known = True
        out.update(dict.fromkeys(served.base))
        out.update(served.adapters)
    if not known:
        return None
    for alias in aliases:  # a public name the router maps to one the fleet serves
        if any(s.model in out for s in alias.served):
            out.setdefault(alias.name, None)
    return dict(sorted(out.items()))


def fallback_order(state: FleetState, now_s: float) -> list[str]:
    """The backends a request without a decision (the policy does not route it) may go to,
    best first: the active ones, available first, then the least loaded (by id on a tie).
    An endpoint picker names them, since the pool's Envoy has no route of its own."""
    active = [b for b in state.backends.values() if b.lifecycle is BackendLifecycle.ACTIVE]
    ranked = sorted(active, key=lambda b: (not state.available(b, now_s), b.load.in_flight, b.id))
    return [b.id for b in ranked]
