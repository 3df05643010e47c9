"""Engine profiles: the constants that turn tokens into milliseconds for one kind of
backend (hardware + model + serving engine). The router uses them to estimate prefill and
queueing time; the emulated engine and the simulator run on them. Built-in profiles live
in ext_proc/estimate/profiles/NAME.yaml; any YAML file with the same keys works.

A profile for the router alone needs only ROUTER_KEYS: the terms in OPTIONAL_KEYS default
to off (a dense model's decode, every batch CUDA-graphed), and EMULATOR_KEYS are read
only by the emulated engine and the simulator, so they default to the shipped profiles'
values (docs/engines.md, "Describe your hardware").
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ext_proc.vocab.backend import DEFAULT_PROFILE

# What the router reads: prefill speed and chunking (PrefillModel), the decode step
# (queue and decode estimates), the KV pool (prefix index size) and the running limit.
ROUTER_KEYS = (
    "prefill_base_ms",
    "prefill_tokens_per_s",
    "prefill_context_tokens",
    "chunk_tokens",
    "decode_base_ms",
    "decode_per_request_ms",
    "decode_per_1k_context_ms",
    "kv_capacity_tokens",
    "max_running_requests",
)
# Decode terms the router reads too, off unless set: the expert-activation term of a
# mixture-of-experts model (batch_ms 0: a dense model) and the eager-step cost past the
# largest CUDA-graphed batch (ms 0: every batch graphed).
OPTIONAL_KEYS = (
    "decode_batch_ms",
    "decode_batch_fraction",
    "no_cuda_graph_batch",
    "no_cuda_graph_ms",
    "kv_bytes_per_token",
)
# Read only by the emulated engine (emulator/) and the simulator (loadgen/), never by the
# router: its cache granularity is routing.block_tokens.
EMULATOR_KEYS = ("block_tokens", "jitter_sigma")


@dataclass(frozen=True)
class EngineProfile:
    """One kind of backend's constants (hardware + model + engine) in ms, tokens and
    tokens/s, loaded by `load_profile`. The router reads ROUTER_KEYS and OPTIONAL_KEYS;
    the emulated engine and the simulator read the rest too."""

    name: str
    prefill_base_ms: float
    prefill_tokens_per_s: float
    prefill_context_tokens: float
    chunk_tokens: int
    decode_base_ms: float
    decode_per_request_ms: float
    decode_per_1k_context_ms: float
    kv_capacity_tokens: int
    max_running_requests: int
    decode_batch_ms: float = 0.0
    # Every shipped profile's; it shapes the term only when decode_batch_ms is set.
    decode_batch_fraction: float = 0.03125
    no_cuda_graph_batch: int = 0
    no_cuda_graph_ms: float = 0.0
    # Emulator-only (EMULATOR_KEYS): the emulated cache's block, and a multiplicative
    # lognormal jitter on every step.
    block_tokens: int = 64
    jitter_sigma: float = 0.02
    # KV bytes per token: 2 (K and V) x attention layers x KV heads x head dim x bytes per
    # element. It sizes a prefill/decode KV transfer (emulator/engine/disagg/kv.py), and
    # the router prices it (core/pairs.py) unless routing.kv_bytes_per_token says. The
    # default is Llama-3.1-8B's in fp16: 2 x 32 x 8 x 128 x 2 = 131072.
    kv_bytes_per_token: int = 131072

    def prefill_ms(self, uncached_tokens: float, cached_tokens: float) -> float:
        """One request's share of a prefill step (without the step's base cost)."""
        u, c = uncached_tokens, cached_tokens
        return u / self.prefill_tokens_per_s * 1e3 * (1 + (c + u / 2) / self.prefill_context_tokens)

    def decode_ms(self, batch: int, context_tokens: int) -> float:
        ms = (
            self.decode_base_ms
            + self.decode_batch_ms * (1 - (1 - self.decode_batch_fraction) ** batch)
            + self.decode_per_request_ms * batch
            + self.decode_per_1k_context_ms * context_tokens / 1000
        )
        return ms + (self.no_cuda_graph_ms if batch > self.no_cuda_graph_batch else 0.0)

    def lone_ttft_ms(self, input_tokens: int, cached_tokens: int = 0) -> float:
        """TTFT of a request alone on an idle engine (no jitter): its chunked prefill."""
        done, ms = cached_tokens, 0.0
        while done < input_tokens:
            u = min(self.chunk_tokens, input_tokens - done)
            ms += self.prefill_base_ms + self.prefill_ms(u, done)
            done += u
        return ms


def profile_names() -> list[str]:
    """The built-in profiles' names (ext_proc/estimate/profiles/NAME.yaml), sorted."""
    return sorted(
        p.name.removesuffix(".yaml")
        for p in resources.files("ext_proc.estimate.profiles").iterdir()
        if p.name.endswith(".yaml")
    )


def load_profile(name_or_path: str = DEFAULT_PROFILE) -> EngineProfile:
    """A built-in profile by name (ext_proc/estimate/profiles/NAME.yaml) or a YAML file path
    (a regular file: a device such as /dev/zero or a FIFO would never end)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if path.exists() and not path.is_file():
            raise ValueError(f"engine profile {name_or_path}: not a regular file")
        try:
            text = path.read_text()
        except OSError as e:
            raise ValueError(f"engine profile {name_or_path}: {e.strerror}") from e
    else:
        ref = resources.files("ext_proc.estimate.profiles").joinpath(f"{name_or_path}.yaml")
        if not ref.is_file():
            known = ", ".join(profile_names())
            raise ValueError(f"unknown engine profile {name_or_path!r} (known: {known})")
        text = ref.read_text()
    return profile_from_dict(yaml.safe_load(text), str(name_or_path))


def profile_from_dict(raw: Any, where: str = "profile") -> EngineProfile:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping")
    names = {f.name: f for f in fields(EngineProfile)}
    unknown = sorted(set(raw) - set(names))
    if unknown:
        near = difflib.get_close_matches(unknown[0], list(names), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(f"{where}: unknown key {unknown[0]!r}{hint}")
    missing = [k for k in ROUTER_KEYS if k not in raw]
    if missing:  # all at once: a hand-written profile should not take one run per key
        raise ValueError(f"{where}: missing keys {', '.join(missing)}")
    if raw.get("no_cuda_graph_ms") and "no_cuda_graph_batch" not in raw:
        raise ValueError(
            f"{where}: no_cuda_graph_ms needs no_cuda_graph_batch (the largest batch the "
            "engine runs as a CUDA graph)"
        )
    # A file's own name when it has none: what /state and the logs call it.
    stem = Path(where).stem if where.endswith((".yaml", ".yml")) else where
    values: dict[str, Any] = {"name": str(raw.get("name", stem))}
    for key, f in names.items():
        if key == "name" or key not in raw:
            continue
        v = raw[key]
        if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
            raise ValueError(f"{where}: {key} must be a non-negative number, got {v!r}")
        values[key] = int(v) if f.type == "int" else float(v)
    p = EngineProfile(**values)
    for key in ("chunk_tokens", "block_tokens", "max_running_requests", "kv_capacity_tokens"):
        if getattr(p, key) < 1:
            raise ValueError(f"{where}: {key} must be >= 1")
    if p.prefill_tokens_per_s <= 0:
        raise ValueError(f"{where}: prefill_tokens_per_s must be > 0")
    if p.prefill_context_tokens <= 0:
        raise ValueError(f"{where}: prefill_context_tokens must be > 0")
    if p.decode_batch_fraction > 1 or (p.decode_batch_ms > 0 and p.decode_batch_fraction == 0):
        raise ValueError(f"{where}: decode_batch_fraction must be in (0, 1]")
    return p
