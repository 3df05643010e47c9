"""Where this package's files are, for whoever runs them by file path with the vLLM
environment's python (they import nothing from this project)."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
LAUNCHER = HERE / "launcher.py"
TINY_MODEL = HERE / "tiny_model.py"
CAPTURE = HERE / "capture.py"
