"""What one emulated engine is configured with: which engine it is the twin of (flavor),
backend id, engine profile, token limits, served model name, tokenizer, the engine's own
launch options (cache report, metrics, KV events) and fault injection."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from emulator.engine.disagg.config import DisaggConfig
from emulator.engine.kv_publisher import KvEventsConfig
from emulator.engine.lora import DEFAULT_MAX_LORAS, LoraAdapters, LoraModule, check_slowdown
from emulator.engine.priority import PriorityScheduling
from ext_proc.estimate.profile import EngineProfile, load_profile
from ext_proc.prompt.chat_template import ChatTemplate
from ext_proc.prompt.tokens import APPROX, Tokenizer
from ext_proc.vocab.backend import DEFAULT_PROFILE

SGLANG, VLLM = "sglang", "vllm"
FLAVORS = (SGLANG, VLLM)
# The vLLM release the vllm flavor is the twin of (../shared/real-engines.md).
VLLM_VERSION = "0.32.0"
# The engines' default page (block) sizes: SGLang 1 token (server_args.py), vLLM 128 on
# this machine's CPU build (../shared/real-engines.md: hits in 128-token blocks).
DEFAULT_PAGE_TOKENS = {SGLANG: 1, VLLM: 128}


def zero_delay_profile(base: EngineProfile) -> EngineProfile:
    """Every step takes no time: isolates proxy overhead in benchmarks."""
    return replace(
        base,
        name=f"{base.name}+zero-delay",
        prefill_base_ms=0.0,
        prefill_tokens_per_s=float("inf"),
        decode_base_ms=0.0,
        decode_batch_ms=0.0,
        decode_per_request_ms=0.0,
        decode_per_1k_context_ms=0.0,
        no_cuda_graph_ms=0.0,
        jitter_sigma=0.0,
    )


# The emulated model's context when no flag sets one (Qwen3's A3B models' config.json,
# max_position_embeddings): both engines then refuse a longer prompt, or a max_tokens
# beyond it (vLLM), with a 400.
DEFAULT_CONTEXT_TOKENS = 262_144


@dataclass
class Faults:
    """Fault injection, for reliability tests; all off by default."""

    # Share of generation requests answered with HTTP 500 at once.
    error_rate: float = 0.0
    # Share of generation requests held for stall_ms before they reach the scheduler.
    stall_rate: float = 0.0
    stall_ms: float = 0.0
    # Share of streamed requests that fail inside their HTTP 200 stream: an error event
    # after stream_error_after tokens (0: as the first chunk), then [DONE].
    stream_error_rate: float = 0.0
    stream_error_after: int = 0
    # The KV event stream is down: batches are numbered and kept for replay, not sent.
    kv_events_down: bool = False

    def validate(self) -> None:
        if not isinstance(self.kv_events_down, bool):
            raise ValueError(f"kv_events_down must be true or false, got {self.kv_events_down!r}")
        if (
            isinstance(self.stream_error_after, bool)
            or not isinstance(self.stream_error_after, int)
            or self.stream_error_after < 0
        ):
            raise ValueError(
                f"stream_error_after must be an integer >= 0, got {self.stream_error_after!r}"
            )
        for key in ("error_rate", "stall_rate", "stream_error_rate"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1:
                raise ValueError(f"{key} must be a number in [0, 1], got {v!r}")
        v = self.stall_ms
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < math.inf:
            raise ValueError(f"stall_ms must be a finite number >= 0, got {v!r}")


@dataclass
class EngineConfig:
    """One emulated backend."""

    name: str  # backend id, e.g. "us-ashburn"; echoed in x-engine-id
    profile: EngineProfile = field(default_factory=lambda: load_profile(DEFAULT_PROFILE))
    default_max_tokens: int = 16  # when the request names no limit
    max_tokens_cap: int = 32768  # requested limits above this are clamped
    model: str = "emulated"  # served model name (/v1/models, responses)
    # vLLM's further --served-model-name names for the same model: requests may name any,
    # responses name `model`, the first (entrypoints/openai/models/serving.py model_name).
    model_aliases: tuple[str, ...] = ()
    # The model directory the engine was started with (vLLM's `serve MODEL`, SGLang's
    # --model-path): the twin's tokenizer directory ("": the served name stands in).
    model_path: str = ""
    seed: int = 0  # step-time jitter and fault draws
    # In-process configs (tests, benchmarks) count 4 bytes per token unless given one;
    # `gorgo engine` loads the tiny model's real tokenizer by default
    # (emulator/engine/tokenizer.py).
    tokenizer: Tokenizer = APPROX
    # The model's chat template (with a real tokenizer; None: '<role>\n<content>\n').
    chat_template: ChatTemplate | None = None
    # vLLM --trust-request-chat-template: a request may bring its own chat_template.
    trust_request_chat_template: bool = False
    faults: Faults = field(default_factory=Faults)
    # Which engine this is the twin of: sglang or vllm.
    flavor: str = SGLANG
    # prompt_tokens_details in usage: SGLang --enable-cache-report, vLLM
    # --enable-prompt-tokens-details.
    cache_report: bool = False
    # Usage in every stream, asked for or not: SGLang --stream-response-default-include-
    # usage, vLLM --enable-force-include-usage.
    default_include_usage: bool = False
    # /metrics: SGLang only with --enable-metrics; vLLM always.
    enable_metrics: bool = False
    # Longest prompt + output: SGLang --context-length, vLLM --max-model-len (None:
    # unbounded; `gorgo engine` always sets one, DEFAULT_CONTEXT_TOKENS unless told, as
    # both engines take the model's own when no flag is given).
    context_length: int | None = None
    # --kv-events-config (None: no events).
    kv_events: KvEventsConfig | None = None
    # SGLang: /health answers 503 for this long after start (its warmup), then runs a
    # one-token generation per call unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false.
    warmup_s: float = 0.0
    health_generation: bool = True
    # How often SGLang's /health looks for output (it sleeps 1 s, then checks: so it
    # takes at least 1 s). Tests shorten it.
    health_poll_s: float = 1.0
    # LoRA (emulator/engine/lora.py): --enable-lora; adapters loaded at start (vLLM
    # --lora-modules, SGLang --lora-paths); how many adapters one batch may hold (vLLM
    # --max-loras, SGLang --max-loras-per-batch; None: the engine's default); and the
    # twin's own step-time factor for adapters' requests (LoRA kernels add work to every
    # step they are in; 1.0: no public figure fits every adapter rank and kernel, so none
    # is assumed), per adapter in LoraModule.slowdown.
    enable_lora: bool = False
    lora_modules: tuple[LoraModule, ...] = ()
    max_loras: int | None = None
    lora_slowdown: float = 1.0
    # vLLM mounts /v1/load_lora_adapter and /v1/unload_lora_adapter only with
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING=true (serve/lora/api_router.py); None: the twin
    # mounts them whenever LoRA is enabled.
    runtime_lora_updating: bool | None = None
    # Priority scheduling (emulator/engine/model/scheduler.py PriorityScheduling; None: off, FCFS):
    # vLLM --scheduling-policy priority; SGLang --enable-priority-scheduling with
    # --schedule-low-priority-values-first, --priority-scheduling-preemption-threshold and
    # --disable-priority-preemption. Off, both engines take a request's priority and
    # ignore it (vLLM 0.32 as measured here: 200, not 400).
    priority: PriorityScheduling | None = None
    # Prefill/decode disaggregation (emulator/engine/disagg/; None: off): SGLang's
    # --disaggregation-mode, vLLM's --kv-transfer-config.
    disagg: DisaggConfig | None = None
    # The adapters loaded now (run-time loads change it), made from lora_modules.
    adapters: LoraAdapters = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("EngineConfig.name must be a non-empty backend id")
        if self.flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {', '.join(FLAVORS)}, got {self.flavor!r}")
        if self.max_tokens_cap < 1:
            raise ValueError(f"EngineConfig.max_tokens_cap must be >= 1, got {self.max_tokens_cap}")
        if self.default_max_tokens < 1:
            raise ValueError(
                f"EngineConfig.default_max_tokens must be >= 1, got {self.default_max_tokens}"
            )
        self.faults.validate()
        if self.lora_modules and not self.enable_lora:
            if self.flavor == VLLM:  # no LoRA config: loading them fails at start
                raise ValueError("--lora-modules needs --enable-lora (vLLM has no LoRA config)")
            self.enable_lora = True  # SGLang: --lora-paths enables LoRA (server_args.py)
        if self.max_loras is None:
            self.max_loras = DEFAULT_MAX_LORAS[self.flavor]
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        self.lora_slowdown = check_slowdown(self.lora_slowdown, "lora_slowdown")
        self.adapters = LoraAdapters(self.lora_modules, self.lora_slowdown)
        if self.priority is not None and self.flavor == VLLM and not self.priority.low_values_first:
            raise ValueError("vLLM's priority scheduling serves lower values first")
        if self.runtime_lora_updating is None:
            self.runtime_lora_updating = self.enable_lora and self.flavor == VLLM

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name the base model is served under, the first the one responses name."""
        return (self.model, *self.model_aliases)

    @classmethod
    def zero_delay(cls, name: str, **overrides: Any) -> EngineConfig:
        """No prefill or decode time at all: isolates proxy overhead in benchmarks."""
        return cls(
            name=name, profile=zero_delay_profile(load_profile(DEFAULT_PROFILE)), **overrides
        )
