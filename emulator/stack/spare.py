"""A warm spare for a Python child of `gorgo up`: its heavy modules imported ahead of time,
waiting on stdin to become that child.

    python -m emulator.stack.spare --preload ext_proc.app ext_proc.cli serve --config F

imports ext_proc.app, then blocks until a line arrives on stdin (or stdin closes: then it
exits), then runs `python -m ext_proc.cli serve --config F` in this process. A router
restarted from a spare skips its Python start-up (~1 s of CPU: 1.5 s on an idle machine
here, 2-8 s on two busy cores), so Envoy's fail-open spell after a crash is about as short
as the supervisor's backoff.
"""

from __future__ import annotations

import argparse
import importlib
import os
import runpy
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m emulator.stack.spare")
    p.add_argument("--preload", action="append", default=[], help="module to import ahead")
    p.add_argument("module", help="the module to run as __main__ once told to")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    for name in a.preload:
        importlib.import_module(name)
    print(
        f"warm spare (pid {os.getpid()}): {', '.join(a.preload) or 'nothing'} loaded, waiting "
        f"to become `{' '.join([a.module, *a.args])}`",
        file=sys.stderr,
        flush=True,
    )
    if not sys.stdin.buffer.readline():
        return 0  # the supervisor went away or dropped this spare
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # as its cold-started twin: nothing on stdin
    os.close(devnull)
    sys.argv = [a.module, *a.args]
    runpy.run_module(a.module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
