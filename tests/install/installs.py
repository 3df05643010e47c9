"""What the install tests share: a fresh virtual environment, pip in it, the project's files
as a clone would hold them, and a `gorgo serve` of an installed router run until ready."""

from __future__ import annotations

import queue
import shutil
import signal
import subprocess
import threading
import venv
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# pip's own cache (~/.cache/pip) is used: the wheels of an earlier run are not downloaded
# again. A long first install (a slow mirror) gets this long.
PIP_TIMEOUT_S = 900


def committed_files(root: Path, paths: Sequence[str]) -> list[str]:
    """The files under `paths` that a commit of the working tree would hold: tracked and
    untracked ones, but none that .gitignore hides (a generated file a clone would lack)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *paths],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return sorted({f for f in out if (root / f).is_file()})  # not files deleted since


def copy_files(root: Path, files: Sequence[str], dest: Path) -> None:
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, dest / f)


def new_venv(path: Path) -> Path:
    """A virtual environment with pip, from this Python; its bin directory."""
    venv.create(path, with_pip=True)
    return path / "bin"


def pip(bin_dir: Path, *args: str | Path, cwd: Path | None = None) -> None:
    subprocess.run(
        [bin_dir / "python", "-m", "pip", "--quiet", *args],
        check=True,
        timeout=PIP_TIMEOUT_S,
        cwd=cwd,
    )


def installed(bin_dir: Path) -> dict[str, str]:
    """name (lower case) -> version of what pip installed in the environment."""
    out = subprocess.run(
        [bin_dir / "python", "-m", "pip", "list", "--format=freeze"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    pairs = (line.split("==", 1) for line in out.splitlines() if "==" in line)
    return {name.lower().replace("_", "-"): version for name, version in pairs}


@contextmanager
def serving(gorgo: Path, config: Path, log: Path, timeout_s: float = 60.0) -> Iterator[str]:
    """`gorgo serve --config` of an installed router until its ready line (yielded); then
    SIGTERM, and it must exit 0 (it drains and stops)."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            [gorgo, "serve", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=out,
            text=True,
            cwd=config.parent,
        )
    try:
        stdout = proc.stdout
        assert stdout is not None
        first: queue.Queue[str] = queue.Queue()
        # the ready line, or "" when it exits first
        threading.Thread(target=lambda: first.put(stdout.readline()), daemon=True).start()
        try:
            line = first.get(timeout=timeout_s)
        except queue.Empty:
            line = f"(nothing in {timeout_s:g} s)"
        if not line.startswith("gorgo serve: ready"):
            raise AssertionError(f"gorgo serve did not start: {line!r}\n{log.read_text()}")
        yield line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
