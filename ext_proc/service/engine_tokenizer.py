"""The engine's tokens, found and checked by the router itself.

A backend's KV events name blocks by the engine's token ids, so its prefix state can be
precise only when the router tokenizes exactly as that engine does. Without a `tokenizer:`
key, the router finds the served model (`GET /v1/models`: `root` is the model path vLLM
and SGLang were started with, `id` the served name) and loads that model's tokenizer.json
and chat template from the model directory or the Hugging Face cache
(ext_proc/prompt/tokenizer_files.py). Whether found or configured, the tokenizer is then
verified against each backend's engine: a probe chat and a plain text are tokenized by the
engine (vLLM: `POST /tokenize` with `messages` or `prompt`,
vllm/entrypoints/serve/tokenize; SGLang: `POST /v1/tokenize` with `prompt`,
python/sglang/srt/entrypoints/openai/serving_tokenize.py, so the rendered chat is sent as
text) and by the router, and the ids compared. This runs at start, whenever a backend's
event stream comes back (a reconnect may be a restarted engine, maybe with another
model), and, as a spot check, on a live request every `SPOT_CHECK_S`. A mismatch, or no
tokenizer to be had, keeps that backend approximate with the reason on /state
(`tokens.reason`), a metric (`gorgo_backend_tokens_ok`) and one log line naming the fix.
An engine without a tokenize endpoint cannot be checked this way: a configured tokenizer
is then trusted, a discovered one too (the model directory is the engine's own), and the
reason says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from ext_proc.common.aio import cancel_and_wait
from ext_proc.config.schema import Config
from ext_proc.core.router import Router
from ext_proc.envoy.server import ExtProcService
from ext_proc.prompt.engine_tokens import EngineTokenizer, PromptTokenizer, load_engine_tokenizer
from ext_proc.prompt.tokenizer_config import TokenizerConfig
from ext_proc.prompt.tokenizer_files import find_tokenizer
from ext_proc.vocab.backend import Backend, EngineKind
from ext_proc.vocab.request import Chat

log = logging.getLogger("gorgo.tokens")

# How often backends whose check is due are looked at (s), and how long one engine call
# may take.
CHECK_S = 2.0
REQUEST_TIMEOUT_S = 5.0
# A live request is re-tokenized by each backend's engine this often (s); a backend that
# failed its check is checked again this often.
SPOT_CHECK_S = 30.0
RETRY_S = 10.0
# What the probe checks: a chat with the template's usual turns (system, user,
# assistant, user), digits, spacing and non-ASCII text, and a plain text.
PROBE_CHAT = Chat(
    messages=(
        {"role": "system", "content": "You are a careful assistant. Answer in one line."},
        {"role": "user", "content": "What is 12 + 30?\n\nShow  the steps: é, 日本."},
        {"role": "assistant", "content": "12 + 30 = 42."},
        {"role": "user", "content": "  And 42 * 2?"},
    )
)
PROBE_TEXT = "The quick brown fox: 1234 jumps over\n\n the lazy dog. ünïcödé"
PENDING = "checking the engine's tokenizer"


class TokenizeUnsupported(Exception):
    """The engine has no tokenize endpoint."""


def first_difference(ours: Sequence[int], theirs: Sequence[int]) -> str:
    """Where two tokenizations part, in words for a log line."""
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
    if at is None:
        return f"{len(ours)} tokens here, {len(theirs)} from the engine"
    return f"token {at} differs ({len(ours)} tokens here, {len(theirs)} from the engine)"


class EngineTokenizers:
    """Finds the tokenizer (when none is configured) and checks it against each backend
    with KV events. `install` receives the tokenizer the shell's sessions should use."""

    def __init__(self, cfg: Config, router: Router, ext_proc: ExtProcService) -> None:
        self.cfg = cfg
        self.router = router
        self._ext_proc = ext_proc
        self.source = "config" if ext_proc.tokens is not None else ""
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        # Per backend: whether its stream was up at the last look (a rise re-checks), when
        # it was last checked, and the served model.
        self._was_up: dict[str, bool] = {}
        self._checked_s: dict[str, float] = {}
        self._models: dict[str, str] = {}
        self._not_found = ""
        self.checks = 0
        self.mismatches = 0

    @property
    def engine(self) -> EngineTokenizer | None:
        """The tokenizer the sessions use (configured, or found and installed)."""
        tokens = self._ext_proc.tokens
        return tokens.engine if tokens is not None else None

    def _watched(self) -> list[Backend]:
        return [b for b in self.router.cfg.backends if b.kv_events.endpoint]

    async def start(self) -> None:
        watched = self._watched()
        for b in watched:
            self.router.inputs.set_token_check(b.id, False, PENDING)
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        )
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
        if self._session is not None:
            await self._session.close()

    def snapshot(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "name": self.engine.tokenizer.name if self.engine is not None else None,
            "not_found": self._not_found or None,
            "models": dict(self._models),
            "checks": self.checks,
            "mismatches": self.mismatches,
        }

    async def _run(self) -> None:
        while True:
            try:
                await self.check_due()
            except Exception:  # never let the checker die: it is what keeps state honest
                log.exception("tokenizer check failed")
            await asyncio.sleep(CHECK_S)

    async def check_due(self) -> None:
        """One round: check every watched backend that was never checked or whose stream
        came back up (in full), that failed (again, every RETRY_S), or that is due a
        spot check of a live request."""
        now_s = time.monotonic()
        for b in self._watched():
            state = self.router.backends.get(b.id)
            if state is None:
                continue
            rose = state.engine.events_up and not self._was_up.get(b.id, False)
            self._was_up[b.id] = state.engine.events_up
            last = self._checked_s.get(b.id)
            if last is None or rose:
                spot = False
            elif not state.engine.tokens.ok:
                if now_s - last < RETRY_S:
                    continue
                spot = False
            elif now_s - last >= SPOT_CHECK_S:
                spot = True
            else:
                continue
            self._checked_s[b.id] = now_s
            await self._check(b, spot)

    async def _check(self, b: Backend, spot: bool) -> None:
        base = f"http://{b.address}"
        try:
            model, root = await self._served_model(base)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            self.router.inputs.set_token_check(
                b.id, False, f"engine not reachable for a check: {e}"
            )
            return
        self._models[b.id] = model
        if self.engine is None:
            await self._discover(b, model, root)
        engine = self.engine
        if engine is None:
            self._fail(b, self._not_found)
            return
        try:
            verdict = await self._verify(b, base, model, engine, spot)
        except TokenizeUnsupported:
            self.router.inputs.set_token_check(
                b.id, True, f"trusted: {b.engine} has no tokenize endpoint to check against"
            )
            return
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            self.router.inputs.set_token_check(b.id, False, f"tokenize check failed: {e}")
            return
        self.checks += 1
        if verdict:
            self.mismatches += 1
            self._fail(b, verdict)
        elif not self.router.backends[b.id].engine.tokens.ok or not spot:
            log.info("backend %s: tokenizer %s matches its engine", b.id, engine.tokenizer.name)
            self.router.inputs.set_token_check(b.id, True, f"verified against {model}")

    def _fail(self, b: Backend, reason: str) -> None:
        state = self.router.backends.get(b.id)
        if state is not None and state.engine.tokens.reason != reason:
            log.warning(
                "backend %s: prefix state approximate: %s. Fix: set tokenizer.path (and "
                "tokenizer.chat_template) to the files the engine serves with",
                b.id,
                reason,
            )
        self.router.inputs.set_token_check(b.id, False, reason)

    async def _served_model(self, base: str) -> tuple[str, str]:
        assert self._session is not None
        async with self._session.get(f"{base}/v1/models") as resp:
            resp.raise_for_status()
            doc = await resp.json(content_type=None)
        data = doc.get("data") if isinstance(doc, Mapping) else None
        if not isinstance(data, list) or not data or not isinstance(data[0], Mapping):
            raise ValueError("/v1/models lists no model")
        # The base model, not an adapter (vLLM lists LoRA adapters with a parent).
        first = next((m for m in data if isinstance(m, Mapping) and not m.get("parent")), data[0])
        return str(first.get("id") or ""), str(first.get("root") or "")

    async def _discover(self, b: Backend, model: str, root: str) -> None:
        found = find_tokenizer([root, model], self.cfg.tokenizer.cache_entries)
        if found.config is None:
            self._not_found = f"engine serves {model!r}: {found.where}"
            return
        engine = await asyncio.to_thread(_load, found.config)
        self.source = f"discovered from {b.id}: {found.where}"
        self._not_found = ""
        log.info("tokenizer of %r found at %s (served by %s)", model, found.where, b.id)
        self._ext_proc.use_tokenizer(PromptTokenizer(engine))

    async def _verify(
        self, b: Backend, base: str, model: str, engine: EngineTokenizer, spot: bool
    ) -> str:
        """ "" when the engine tokenizes as the router does, else what differs."""
        tokens = self._ext_proc.tokens  # the sessions' tokenizer: its last request
        sample = tokens.last if spot and tokens is not None else None
        chat, text, ours_sample = sample if sample is not None else (None, None, ())
        chats = [(PROBE_CHAT, tuple(await asyncio.to_thread(engine.chat_ids, PROBE_CHAT)))]
        texts = [(PROBE_TEXT, tuple(engine.text_ids(PROBE_TEXT, special=True)))]
        if chat is not None:
            chats.append((chat, ours_sample))
        elif text is not None:
            texts.append((text, ours_sample))
        for c, ours in chats:
            theirs = await self._tokenize_chat(b, base, model, c, engine)
            if theirs != ours:
                what = "a live request" if c is not PROBE_CHAT else "the probe chat"
                return f"the engine tokenizes {what} differently: {first_difference(ours, theirs)}"
        for t, ours in texts:
            theirs = await self._tokenize(b, base, {"model": model, "prompt": t})
            if theirs != ours:
                return f"the engine tokenizes text differently: {first_difference(ours, theirs)}"
        return ""

    async def _tokenize_chat(
        self, b: Backend, base: str, model: str, chat: Chat, engine: EngineTokenizer
    ) -> tuple[int, ...]:
        if b.engine == EngineKind.VLLM:
            body: dict[str, Any] = {
                "model": model,
                "messages": list(chat.messages),
                "add_generation_prompt": chat.add_generation_prompt,
                "continue_final_message": chat.continue_final_message,
            }
            if chat.tools is not None:
                body["tools"] = list(chat.tools)
            if chat.template_kwargs:
                body["chat_template_kwargs"] = dict(chat.template_kwargs)
            if chat.template is not None:
                body["chat_template"] = chat.template
            return await self._tokenize(b, base, body)
        # SGLang tokenizes text only: the router's rendering, without special tokens.
        rendered = await asyncio.to_thread(engine.render, chat)
        return await self._tokenize(
            b, base, {"model": model, "prompt": rendered, "add_special_tokens": False}
        )

    async def _tokenize(self, b: Backend, base: str, body: dict[str, Any]) -> tuple[int, ...]:
        assert self._session is not None
        path = "/tokenize" if b.engine == EngineKind.VLLM else "/v1/tokenize"
        if b.engine != EngineKind.VLLM and "add_special_tokens" not in body:
            body = {**body, "add_special_tokens": True}  # as vLLM's completions default
        async with self._session.post(f"{base}{path}", json=body) as resp:
            if resp.status in (404, 405):
                raise TokenizeUnsupported(path)
            resp.raise_for_status()
            doc = await resp.json(content_type=None)
        tokens = doc.get("tokens") if isinstance(doc, Mapping) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ValueError(f"{path}: no token ids in the answer")
        return tuple(tokens)


def _load(cfg: TokenizerConfig) -> EngineTokenizer:
    engine = load_engine_tokenizer(cfg)
    assert engine is not None  # a path is set
    return engine
