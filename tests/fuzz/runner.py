"""One fuzz target under atheris (libFuzzer's engine): its seed corpus, its dictionary and
the limits every target shares. Imports nothing of the product, so that a target imports
the product inside `atheris.instrument_imports` (instrumented: coverage-guided).

The seeds (tests/fuzz/corpus/NAME/, small files in the repository, and every input that
once found a bug) are read, never written: what the run finds goes to a scratch directory
(FUZZ_WORK, else a new temporary one), and a crashing or hanging input to
out/fuzz/NAME/ (libFuzzer's crash-*, timeout-* files) to become a regression test."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CORPORA = HERE / "corpus"
DICTS = HERE / "dicts"
# An input that takes longer than this is a hang (libFuzzer's -timeout): every reader here
# is linear in its input of at most a few KiB and takes well under a millisecond; 10 s
# leaves room for a loaded machine and a first call that compiles or loads something.
TIMEOUT_S = 10
# Inputs up to this size by default (libFuzzer's own default is 4096).
MAX_LEN = 4096


def findings(name: str) -> list[Path]:
    """The inputs that once made target `name` crash or hang, which the unit tests
    replay: fuzz inputs as such (tests/fuzz/corpus/NAME/finding-*, seeds too), or the
    messages a target built of one (tests/fuzz/findings/NAME/*)."""
    return sorted([*(CORPORA / name).glob("finding-*"), *(HERE / "findings" / name).glob("*")])


def write_messages(path: Path, messages: list[bytes]) -> None:
    """A finding that is a sequence of messages (tests/fuzz/findings/): each one's length
    (4 bytes, big-endian), then its bytes."""
    path.write_bytes(b"".join(len(m).to_bytes(4, "big") + m for m in messages))


def read_messages(path: Path) -> list[bytes]:
    data, out = path.read_bytes(), []
    while data:
        n = int.from_bytes(data[:4], "big")
        out.append(data[4 : 4 + n])
        data = data[4 + n :]
    return out


def libfuzzer_args(name: str, argv: list[str], max_len: int = MAX_LEN) -> list[str]:
    """The flags and directories for target `name`: defaults first (a flag given in argv
    wins: libFuzzer takes the last), then argv's own; the corpus directories unless argv
    names inputs to run (reproducing a crash: `python -m tests.fuzz.NAME crash-file`)."""
    artifacts = Path(os.environ.get("FUZZ_ARTIFACTS") or ROOT / "out" / "fuzz" / name)
    artifacts.mkdir(parents=True, exist_ok=True)
    args = [
        f"-timeout={TIMEOUT_S}",
        f"-max_len={max_len}",
        f"-artifact_prefix={artifacts}/",
    ]
    dict_file = DICTS / f"{name}.dict"
    if dict_file.is_file():
        args.append(f"-dict={dict_file}")
    own = argv[1:]
    if not any(not a.startswith("-") for a in own):
        work = os.environ.get("FUZZ_WORK") or tempfile.mkdtemp(prefix=f"gorgo-fuzz-{name}-")
        Path(work).mkdir(parents=True, exist_ok=True)
        # libFuzzer writes new inputs to the first directory only.
        own = [*own, work, str(CORPORA / name)]
    return [argv[0], *args, *own]


def fuzz(name: str, one_input: Callable[[bytes], None], max_len: int = MAX_LEN) -> None:
    """Run `one_input` under libFuzzer with sys.argv's flags; never returns (atheris exits
    the process when the run ends: 0 clean, non-zero on a crash or hang)."""
    import atheris

    atheris.Setup(libfuzzer_args(name, sys.argv, max_len), one_input)
    atheris.Fuzz()
