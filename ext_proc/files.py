"""Files the service and its tools write."""

from __future__ import annotations

from pathlib import Path


def write_atomic(path: str | Path, text: str) -> None:
    """Write through a temporary file and rename it over the target: a crash or a
    concurrent reader sees the old file or the new one, never half of one."""
    p = Path(path)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(p)
