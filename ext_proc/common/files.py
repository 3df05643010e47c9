"""Files the service and its tools write."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomic(path: str | Path, text: str) -> None:
    """Write a temporary file in the same directory and rename it over the target: a crash
    or a concurrent reader sees the old file or the new one, never half of one (Envoy's
    filesystem xDS reloads on the rename). The temporary name is unique, so two writers
    never share a half-written file."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
