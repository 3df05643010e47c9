"""Engine profiles: the constants that turn tokens into milliseconds for one kind of
backend (hardware + model + serving engine). The router uses them to estimate prefill and
queueing time; the emulated engine and the simulator run on them. Built-in profiles live
in ext_proc/estimate/profiles/NAME.yaml; any YAML file with the same keys works.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

DEFAULT_PROFILE = "l40s-qwen3.5-35b-a3b-fp8"


@dataclass(frozen=True)
class EngineProfile:
    name: str
    prefill_base_ms: float
    prefill_tokens_per_s: float
    prefill_context_tokens: float
    chunk_tokens: int
    decode_base_ms: float
    decode_batch_ms: float
    decode_batch_fraction: float
    decode_per_request_ms: float
    decode_per_1k_context_ms: float
    no_cuda_graph_batch: int
    no_cuda_graph_ms: float
    kv_capacity_tokens: int
    max_running_requests: int
    block_tokens: int
    jitter_sigma: float

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


def load_profile(name_or_path: str = DEFAULT_PROFILE) -> EngineProfile:
    """A built-in profile by name (ext_proc/estimate/profiles/NAME.yaml) or a YAML file path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        try:
            text = path.read_text()
        except OSError as e:
            raise ValueError(f"engine profile {name_or_path}: {e.strerror}") from e
    else:
        ref = resources.files("ext_proc.estimate.profiles").joinpath(f"{name_or_path}.yaml")
        if not ref.is_file():
            known = sorted(
                p.name.removesuffix(".yaml")
                for p in resources.files("ext_proc.estimate.profiles").iterdir()
                if p.name.endswith(".yaml")
            )
            raise ValueError(f"unknown engine profile {name_or_path!r} (known: {', '.join(known)})")
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
    missing = sorted(set(names) - set(raw))
    if missing:  # all at once: a hand-written profile should not take one run per key
        raise ValueError(f"{where}: missing keys {', '.join(missing)}")
    values: dict[str, Any] = {}
    for key, f in names.items():
        v = raw[key]
        if f.type == "str":
            values[key] = str(v)
            continue
        if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
            raise ValueError(f"{where}: {key} must be a non-negative number, got {v!r}")
        values[key] = int(v) if f.type == "int" else float(v)
    for key in ("chunk_tokens", "block_tokens", "max_running_requests", "kv_capacity_tokens"):
        if values[key] < 1:
            raise ValueError(f"{where}: {key} must be >= 1")
    if values["prefill_tokens_per_s"] <= 0:
        raise ValueError(f"{where}: prefill_tokens_per_s must be > 0")
    return EngineProfile(**values)
