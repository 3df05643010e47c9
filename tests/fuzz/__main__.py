"""Every fuzz target, one after another, each in its own process (atheris exits when a
run ends): `python -m tests.fuzz [--seconds N] [TARGET ...]` (`make fuzz`: 180 s each,
FUZZ_SECONDS to change it). Prints a line per target (seconds run, inputs tried, the
result) and exits non-zero if any crashed or hung; its input is in out/fuzz/TARGET/."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.fuzz.runner import ROOT

TARGETS = (
    "body",
    "chat_tokens",
    "codec",
    "session",
    "access_log",
    "engine_metrics",
    "kv_events",
    "peer_events",
    "config",
)


@dataclass(frozen=True)
class Run:
    """One target's run: how long, how many inputs, and how it ended."""

    target: str
    seconds: float
    runs: int
    returncode: int
    tail: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def run_target(target: str, seconds: float, extra: tuple[str, ...] = ()) -> Run:
    """Fuzz `target` for `seconds` (libFuzzer's -max_total_time) in a child process."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"gorgo-fuzz-{target}-") as work:
        proc = subprocess.run(
            [sys.executable, "-m", f"tests.fuzz.{target}", f"-max_total_time={seconds:g}", *extra],
            cwd=ROOT,
            env={**os.environ, "FUZZ_WORK": work},  # what the run finds: gone after it
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # libFuzzer's lines and the Python traceback
            text=True,
            errors="replace",
            check=False,
        )
    found = re.findall(r"^Done (\d+) runs", proc.stdout, re.MULTILINE)
    lines = proc.stdout.splitlines()
    # the traceback of a crash, else the last lines
    at = next((i for i, line in enumerate(lines) if "Uncaught Python exception" in line), None)
    tail = "\n".join(lines[at : at + 40] if at is not None else lines[-40:])
    return Run(
        target, time.monotonic() - start, int(found[-1]) if found else 0, proc.returncode, tail
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    ap.add_argument("--seconds", type=float, default=180.0, help="per target (default 180)")
    ap.add_argument("targets", nargs="*", help=f"of {', '.join(TARGETS)} (default: all)")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.targets) - set(TARGETS))
    if unknown:
        ap.error(f"unknown target(s) {', '.join(unknown)}; known: {', '.join(TARGETS)}")
    failed = []
    for target in args.targets or TARGETS:
        r = run_target(target, args.seconds)
        verdict = "ok" if r.ok else f"FAILED (exit {r.returncode})"
        print(f"{target:16} {r.seconds / 60:5.1f} min {r.runs:>11,} inputs  {verdict}", flush=True)
        if not r.ok:
            print(r.tail, flush=True)
            failed.append(target)
    artifacts = Path(ROOT / "out" / "fuzz")
    if failed:
        print(f"{len(failed)} target(s) failed: {', '.join(failed)}; inputs in {artifacts}/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
