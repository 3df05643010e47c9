"""Create the virtual environment that holds the rival routers users deploy instead of gorgo:
the SGLang Model Gateway (``smg``) and vllm-router, both Rust binaries shipped as wheels.

Usage (from the project root, with the system python; stdlib only)::

    python3 -m emulator.rivals.install [VENV] [--force]
    python3 emulator/rivals/install.py [VENV] [--force]

VENV defaults to ``.venv-peers`` in the project root (``make peers``). Steps:

1. ``python3 -m venv VENV``;
2. ``VENV/bin/pip install smg==1.13.0 vllm-router==0.1.17`` (~10 s here);
3. a stamp file ``VENV/.gorgo-peers-installed``: a second run with the same pins does nothing.

The rivals are harness-only (``gorgo bench peers``, tests/peers): never a dependency of the
router.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

# The versions docs/ and ../shared/peer-routers.md describe (flags checked against their
# --help); a new pin needs the flags in emulator/rivals/fronts.py checked again.
REQUIREMENTS = ("smg==1.13.0", "vllm-router==0.1.17")
# Each tool's console script, as its wheel installs it.
TOOLS = ("smg", "vllm-router")
STAMP_NAME = ".gorgo-peers-installed"  # the name installs already have
PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = PROJECT_ROOT / ".venv-peers"


class RivalsNotInstalled(RuntimeError):
    """The rivals' venv is missing or unfinished; ``make peers`` creates it."""


def _log(start: float, message: str) -> None:
    print(f"[rivals-install {time.monotonic() - start:6.1f}s] {message}", flush=True)


def _run(start: float, cmd: Sequence[str], check: bool = True) -> int:
    _log(start, "$ " + " ".join(str(c) for c in cmd))
    return subprocess.run(list(cmd), check=check).returncode


def _stamp_content() -> dict[str, object]:
    return {"requirements": list(REQUIREMENTS)}


def is_installed(venv: Path = DEFAULT_VENV) -> bool:
    """True if ``venv`` holds a finished install with the current pins and both tools."""
    stamp = venv / STAMP_NAME
    if not stamp.is_file() or not (venv / "bin" / "python").exists():
        return False
    try:
        data = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(data, dict):
        return False
    if any(data.get(k) != v for k, v in _stamp_content().items()):
        return False
    return all((venv / "bin" / tool).exists() for tool in TOOLS)


def install(venv: Path = DEFAULT_VENV, force: bool = False) -> int:
    start = time.monotonic()
    venv = venv.resolve()
    if not force and is_installed(venv):
        _log(start, f"{venv}: already installed ({', '.join(REQUIREMENTS)}); nothing to do")
        return 0
    if force and venv.exists():
        _log(start, f"--force: removing {venv}")
        shutil.rmtree(venv)
    (venv / STAMP_NAME).unlink(missing_ok=True)
    system_python = shutil.which("python3") or sys.executable
    if not (venv / "bin" / "python").exists():
        _run(start, [system_python, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    _run(start, [str(python), "-m", "pip", "install", "--quiet", *REQUIREMENTS])
    missing = [tool for tool in TOOLS if not (venv / "bin" / tool).exists()]
    if missing:
        _log(start, f"pip installed no {', '.join(missing)} script in {venv / 'bin'}")
        return 1
    stamp = {
        **_stamp_content(),
        "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds": round(time.monotonic() - start, 1),
    }
    (venv / STAMP_NAME).write_text(json.dumps(stamp, indent=1) + "\n")
    _log(start, f"done: {venv}")
    return 0


def ensure_installed(venv: Path = DEFAULT_VENV) -> Path:
    """The rivals' venv, installed first if it is not (a no-op when the stamp is current)."""
    if not is_installed(venv):
        try:
            rc = install(venv)
        except subprocess.CalledProcessError as e:
            raise RivalsNotInstalled(f"installing the rival routers into {venv} failed: {e}") from e
        if rc != 0:
            raise RivalsNotInstalled(f"installing the rival routers into {venv} failed (rc {rc})")
    return venv


def rival_binary(tool: str, venv: Path = DEFAULT_VENV) -> Path:
    """The console script of ``tool`` ("smg" or "vllm-router") in the rivals' venv."""
    if tool not in TOOLS:
        raise ValueError(f"unknown rival tool {tool!r}: expected one of {', '.join(TOOLS)}")
    path = venv / "bin" / tool
    if not is_installed(venv) or not path.exists():
        raise RivalsNotInstalled(
            f"{tool} is not installed in {venv}: run `make peers` "
            f"(or python3 -m emulator.rivals.install {venv})"
        )
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument(
        "venv",
        nargs="?",
        type=Path,
        default=DEFAULT_VENV,
        help=f"virtual environment to create (default {DEFAULT_VENV})",
    )
    parser.add_argument("--force", action="store_true", help="remove VENV and install anew")
    args = parser.parse_args(argv)
    try:
        return install(args.venv, args.force)
    except subprocess.CalledProcessError as e:
        print(f"rivals-install: failed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
