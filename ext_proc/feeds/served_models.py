"""What a backend serves, from its engine's `GET /v1/models`, pure.

Both engines answer in OpenAI's list shape (`{"object": "list", "data": [...]}`), one entry
per name a request may give as `model`:
- vLLM (vllm/entrypoints/openai/serving_models.py `show_available_models`): each served
  name of the base model (`--served-model-name` may give several) with `root` its model
  path and `parent` null, then each LoRA adapter loaded (`--lora-modules`, or at run time
  by `/v1/load_lora_adapter`) with `root` the adapter's path and `parent` the base model's
  first served name; `max_model_len` on the base entries;
- SGLang (sglang/srt/entrypoints/http_server.py `available_models`): the served name, and
  its LoRA adapters (`--lora-paths`) with `parent` the served name.
An adapter shares its engine with the base model but neither its KV cache (both engines
key an adapter's blocks by it) nor its speed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


class ModelsError(ValueError):
    """A /v1/models answer the router cannot read (names what is wrong)."""


@dataclass(frozen=True)
class ServedModels:
    """The names a backend answers to: base models and adapters (name -> its parent)."""

    base: frozenset[str]
    adapters: Mapping[str, str] = field(default_factory=dict)
    # The context limit the engine reports (None: not reported).
    max_model_len: int | None = None

    @property
    def names(self) -> frozenset[str]:
        return self.base | frozenset(self.adapters)

    def serves(self, model: str) -> bool:
        return model in self.base or model in self.adapters

    def restricted_to(self, allowed: Iterable[str]) -> ServedModels:
        """Only the names in `allowed` (config's `backends[].models`)."""
        keep = frozenset(allowed)
        return ServedModels(
            self.base & keep,
            {a: p for a, p in self.adapters.items() if a in keep},
            self.max_model_len,
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "base": sorted(self.base),
            "adapters": dict(sorted(self.adapters.items())),
            "max_model_len": self.max_model_len,
        }


def parse_models(doc: Any) -> ServedModels:
    """A /v1/models body (decoded JSON) as the names it serves."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("data"), list):
        raise ModelsError("expected an object with a 'data' list")
    base: set[str] = set()
    adapters: dict[str, str] = {}
    max_len: int | None = None
    for i, entry in enumerate(doc["data"]):
        name = entry.get("id") if isinstance(entry, Mapping) else None
        if not isinstance(name, str) or not name:
            raise ModelsError(f"data[{i}]: no model id")
        parent = entry.get("parent")
        if isinstance(parent, str) and parent and parent != name:
            adapters[name] = parent
        else:
            base.add(name)
            length = entry.get("max_model_len")
            if isinstance(length, int) and not isinstance(length, bool) and length > 0:
                max_len = length if max_len is None else min(max_len, length)
    if not base and not adapters:
        raise ModelsError("the engine lists no model")
    return ServedModels(frozenset(base), adapters, max_len)
