"""The engine's tokens, found and checked by the router itself.

A backend's KV events name blocks by the engine's token ids, so its prefix state can be
precise only when the router tokenizes exactly as that engine does. Without a
`tokenizer:` key, the router finds the served model (`GET /v1/models`: `root` is the
model path vLLM and SGLang were started with, `id` the served name) and loads that
model's tokenizer.json and chat template from the model directory or the Hugging Face
cache (ext_proc/prompt/tokenizer_files.py). Whether found or configured, the tokenizer is
then verified against each backend's engine: a probe chat and a plain text are tokenized
by the engine (vLLM: `POST /tokenize` with `messages` or `prompt`,
vllm/entrypoints/serve/tokenize; SGLang: `POST /v1/tokenize` with `prompt`,
python/sglang/srt/entrypoints/openai/serving_tokenize.py, so the rendered chat is sent as
text) and by the router, and the ids compared (tokenize_client.py). This runs at start,
whenever a backend's event stream comes back (a reconnect may be a restarted engine,
maybe with another model), and, as a spot check, on a live request every `SPOT_CHECK_S`.
A mismatch, or no tokenizer to be had, keeps that backend approximate with the reason on
/state (`tokens.reason`), a metric (`gorgo_backend_tokens_ok`) and one log line naming
the fix. An engine without a tokenize endpoint cannot be checked this way: a configured
tokenizer is then trusted, a discovered one too (the model directory is the engine's
own), and the reason says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp

from ext_proc.common.aio import cancel_and_wait
from ext_proc.config.schema import Config
from ext_proc.core.router import Router
from ext_proc.envoy.server import ExtProcService
from ext_proc.prompt.engine_tokens import EngineTokenizer, PromptTokenizer, load_engine_tokenizer
from ext_proc.prompt.tokenizer_config import TokenizerConfig
from ext_proc.prompt.tokenizer_files import find_tokenizer
from ext_proc.service.tokenize_client import TokenizeUnsupported, served_model, verify_tokens
from ext_proc.vocab.backend import Backend

log = logging.getLogger("gorgo.tokens")

# How often backends whose check is due are looked at (s), and how long one engine call
# may take.
CHECK_S = 2.0
REQUEST_TIMEOUT_S = 5.0
# A live request is re-tokenized by each backend's engine this often (s); a backend that
# failed its check is checked again this often.
SPOT_CHECK_S = 30.0
RETRY_S = 10.0
PENDING = "checking the engine's tokenizer"


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
        assert self._session is not None
        try:
            model, root = await served_model(self._session, b.address)
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
            verdict = await self._verify(b, model, engine, spot)
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

    async def _verify(self, b: Backend, model: str, engine: EngineTokenizer, spot: bool) -> str:
        """ "" when the engine tokenizes as the router does, else what differs."""
        assert self._session is not None
        tokens = self._ext_proc.tokens  # the sessions' tokenizer: its last request
        sample = tokens.last if spot and tokens is not None else None
        return await verify_tokens(self._session, b, model, engine, sample)


def _load(cfg: TokenizerConfig) -> EngineTokenizer:
    engine = load_engine_tokenizer(cfg)
    assert engine is not None  # a path is set
    return engine
