"""LoRA adapters as the engines serve them, pure: the adapters an engine has loaded, how
they are named at launch, loaded and unloaded at run time, and what vLLM's
`vllm:lora_requests_info` gauge says of them.

vLLM (docs/engines.md "Models and LoRA adapters"):
- `--enable-lora` gives the engine a LoRA config; `--lora-modules name=path` (or the JSON
  form {"name", "path", "base_model_name"}) loads adapters at start
  (entrypoints/openai/cli_args.py LoRAParserAction, models/serving.py init_static_loras);
- each adapter gets an integer id from a counter starting at 1 (`lora_int_id`, kept when an
  adapter is reloaded in place) and is served under its name (models/serving.py
  load_lora_adapter); a request names the adapter in `model`;
- at run time `POST /v1/load_lora_adapter` {"lora_name", "lora_path", "load_inplace"} and
  `POST /v1/unload_lora_adapter` {"lora_name"} answer 200 with a text body, or an
  ErrorResponse with its code (serve/lora/api_router.py; models/serving.py
  _check_load_lora_adapter_request, _check_unload_lora_adapter_request).

SGLang: `--lora-paths NAME=PATH` (or PATH, named by itself) loads adapters at start and
enables LoRA (server_args.py); its /v1/models lists them (http_server.py
available_models). The twin does not pick an SGLang adapter for a request.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The directory a fleet file's bare adapter name stands for (the twin loads no weights:
# the path is only what /v1/models reports as the adapter's root).
SYNTHETIC_LORA_ROOT = "/lora"
# vLLM --max-loras (config/lora.py LoRAConfig.max_loras) and SGLang --max-loras-per-batch
# (server_args.py) defaults.
DEFAULT_MAX_LORAS = {"vllm": 1, "sglang": 8}
# vLLM's worker when the engine has no LoRA config (worker/lora_model_runner_mixin.py).
LORA_NOT_ENABLED = "LoRA is not enabled. Use --enable-lora to enable LoRA."


@dataclass(frozen=True)
class LoraModule:
    """An adapter named at launch. `slowdown`: the twin's own, how much longer its
    requests' steps take than the base model's (None: the engine's lora_slowdown)."""

    name: str
    path: str
    slowdown: float | None = None


@dataclass(frozen=True)
class LoraAdapter:
    """A loaded adapter: vLLM's LoRARequest (lora_name, lora_int_id, lora_path)."""

    name: str
    int_id: int
    path: str
    slowdown: float = 1.0


def parse_lora_module(text: str, flag: str = "--lora-modules") -> LoraModule:
    """One `--lora-modules` item: name=path, or vLLM's JSON {"name", "path"} (the twin
    also reads "slowdown" there); `--lora-paths` also takes a bare PATH (SGLang names it by
    itself)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{flag} {text!r}: not JSON ({e})") from None
        name, path = doc.get("name"), doc.get("path")
        slowdown = doc.get("slowdown")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"{flag} {text!r}: needs a non-empty 'name' and 'path'")
        return LoraModule(name, path, check_slowdown(slowdown, flag) if slowdown else None)
    name, sep, path = text.partition("=")
    if not sep and flag == "--lora-paths":
        name = path = text
    if not name or not path:
        raise ValueError(f"{flag} {text!r}: expected NAME=PATH")
    return LoraModule(name, path)


def fleet_module(entry: str) -> LoraModule:
    """A fleet file's adapter: NAME (a synthetic path under SYNTHETIC_LORA_ROOT) or
    NAME=PATH."""
    name, sep, path = entry.partition("=")
    return LoraModule(name, path if sep else f"{SYNTHETIC_LORA_ROOT}/{name}")


def check_slowdown(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 1 <= value < 1e6:
        raise ValueError(f"{where}: a LoRA slowdown must be a number >= 1, got {value!r}")
    return float(value)


class LoraError(Exception):
    """An answer other than 200 to a load or unload, in vLLM's ErrorResponse terms."""

    def __init__(self, status: int, message: str, err_type: str) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type = status, message, err_type


class LoraAdapters:
    """The adapters an engine has loaded, by name, in load order."""

    def __init__(self, modules: Sequence[LoraModule] = (), slowdown: float = 1.0) -> None:
        self.default_slowdown = slowdown
        self._by_name: dict[str, LoraAdapter] = {}
        self._next_id = 1
        for m in modules:
            self.load(m.name, m.path, slowdown=m.slowdown)

    def __iter__(self) -> Iterator[LoraAdapter]:
        return iter(list(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str) -> LoraAdapter | None:
        return self._by_name.get(name)

    def load(
        self, name: str, path: str, inplace: bool = False, slowdown: float | None = None
    ) -> LoraAdapter:
        """vLLM models/serving.py load_lora_adapter: both names given, not loaded already
        unless in place (which keeps the adapter's id)."""
        if not name or not path:
            raise LoraError(
                400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"
            )
        old = self._by_name.get(name)
        if old is not None and not inplace:
            raise LoraError(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        if old is not None:
            int_id = old.int_id
        else:
            int_id, self._next_id = self._next_id, self._next_id + 1
        factor = slowdown if slowdown is not None else self.default_slowdown
        adapter = LoraAdapter(name, int_id, path, factor)
        self._by_name[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        """vLLM models/serving.py unload_lora_adapter."""
        if not name:
            raise LoraError(
                400,
                "'lora_name' needs to be provided to unload a LoRA adapter.",
                "InvalidUserInput",
            )
        if self._by_name.pop(name, None) is None:
            raise LoraError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")


def namespaced_blocks(blocks: Sequence[int], adapter: str) -> tuple[int, ...]:
    """An adapter's request's block keys: every chained key hashed with the adapter's name,
    so no block of it matches the base model's or another adapter's (vLLM hashes the
    LoRA name into every block of an adapter's request as an extra key:
    v1/core/kv_cache_utils.py _gen_lora_extra_hash_keys, generate_block_hash_extra_keys).
    Each key still names its whole prefix, so the chain stays a chain."""
    tag = adapter.encode()
    out = []
    for h in blocks:
        d = hashlib.blake2b(tag + (h & (1 << 64) - 1).to_bytes(8, "big"), digest_size=8)
        out.append(int.from_bytes(d.digest(), "big", signed=True))
    return tuple(out)


def go_float(value: float) -> str:
    """A sample value as prometheus_client prints it (utils.py floatToGoString): a
    timestamp as 1.789828498802105e+09."""
    s = repr(float(value))
    dot = s.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return s


class LoraInfoGauge:
    """vllm:lora_requests_info (v1/metrics/loggers.py): a gauge labelled max_lora,
    waiting_lora_adapters, running_lora_adapters (the adapters' names, comma-joined, in
    the order the scheduler meets them), set to the current time whenever stats are
    logged. prometheus_client keeps every label set it was given, each with the time it
    was last set: a reader takes the newest. Here a set is stamped when /metrics is read
    (vLLM: at each engine step's stats)."""

    NAME = "vllm:lora_requests_info"

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._series: dict[tuple[str, str], float] = {}

    def lines(
        self, running: Mapping[str, int], waiting: Mapping[str, int], now_s: float | None = None
    ) -> list[str]:
        key = (",".join(waiting), ",".join(running))
        self._series[key] = time.time() if now_s is None else now_s
        out = [f"# TYPE {self.NAME} gauge"]
        for (wait, run), ts in self._series.items():
            labels = (
                f'max_lora="{self.max_loras}",waiting_lora_adapters="{wait}",'
                f'running_lora_adapters="{run}"'
            )
            out.append(f"{self.NAME}{{{labels}}} {go_float(ts)}")
        return out
