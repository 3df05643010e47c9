"""JSON-like values drawn from fuzz bytes: objects whose keys come mostly from a reader's
own vocabulary, so that a mutated input reaches past "not valid JSON" into the fields."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import atheris

# Scalars a reader has to refuse or take: edge integers, non-finite-looking floats, text
# that is not what it seems.
_SCALARS: tuple[Any, ...] = (
    None,
    True,
    False,
    0,
    -1,
    1,
    2**63,
    -(2**63),
    1.5,
    -0.0,
    1e308,
    "",
    "0",
    "-1",
    "\u00b2",
    "x" * 40,
)


def value(fdp: atheris.FuzzedDataProvider, keys: Sequence[str], depth: int = 4) -> Any:
    """One value; objects take keys from `keys` (or a fuzzed one) at most `depth` deep."""
    kind = fdp.ConsumeIntInRange(0, 7 if depth > 0 else 4)
    if kind == 0:
        return _SCALARS[fdp.ConsumeIntInRange(0, len(_SCALARS) - 1)]
    if kind == 1:
        return fdp.ConsumeInt(4)
    if kind == 2:
        return fdp.ConsumeRegularFloat()
    if kind in (3, 4):
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 24))
    if kind == 5:
        return [value(fdp, keys, depth - 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    out: dict[Any, Any] = {}
    for _ in range(fdp.ConsumeIntInRange(0, 6)):
        out[_key(fdp, keys)] = value(fdp, keys, depth - 1)
    return out


def _key(fdp: atheris.FuzzedDataProvider, keys: Sequence[str]) -> Any:
    """A known key mostly, else any text, or (YAML has them; JSON makes them text) a
    number, a boolean or null."""
    pick = fdp.ConsumeIntInRange(0, 7)
    if pick == 0:
        return (None, True, 1, -1, 0.5)[fdp.ConsumeIntInRange(0, 4)]
    if pick < 3 or not keys:
        return fdp.ConsumeUnicodeNoSurrogates(8)
    return keys[fdp.ConsumeIntInRange(0, len(keys) - 1)]


def obj(fdp: atheris.FuzzedDataProvider, keys: Sequence[str], depth: int = 4) -> dict[Any, Any]:
    """An object at the top (what a request body or a config file is)."""
    out: dict[Any, Any] = {}
    for _ in range(fdp.ConsumeIntInRange(1, 8)):
        out[_key(fdp, keys)] = value(fdp, keys, depth)
    return out
