"""The tiny model the real-vLLM tier serves, built once into the vLLM environment."""

from __future__ import annotations

import subprocess
from pathlib import Path

from emulator.vllm import TINY_MODEL


def ensure_tiny_model(venv: Path, seed: int = 0) -> Path:
    """The model directory inside `venv` (built there with the venv's python on first use:
    ~7 s, 4.6 MB, byte-identical for a seed)."""
    out = venv / f"tiny-model-seed{seed}"
    if not (out / "config.json").exists():
        subprocess.run(
            [str(venv / "bin" / "python"), str(TINY_MODEL), str(out), "--seed", str(seed)],
            check=True,
            capture_output=True,
        )
    return out
