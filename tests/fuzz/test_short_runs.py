"""A short run of every fuzz target (seconds each, in its own process: atheris exits when
a run ends): its seeds and findings first, then new inputs, with no crash or hang. The
long runs are `make fuzz` (python -m tests.fuzz), outside CI."""

from __future__ import annotations

import pytest

from tests.fuzz.__main__ import TARGETS, run_target
from tests.fuzz.runner import CORPORA

pytest.importorskip(
    "atheris", reason="atheris (the dev extra; Linux x86-64 wheels) runs the targets"
)

# Seconds of fuzzing per target here (libFuzzer counts whole seconds): with each
# process's start and instrumentation (~2-5 s) the nine take ~35 s of `make test`.
SHORT_SECONDS = 1


@pytest.mark.parametrize("target", TARGETS)
def test_a_short_run_finds_nothing(target: str) -> None:
    r = run_target(target, SHORT_SECONDS)
    assert r.ok, f"{target} crashed or hung (input in out/fuzz/{target}/):\n{r.tail}"
    seeds = sum(1 for p in (CORPORA / target).iterdir() if p.is_file())
    assert r.runs >= seeds, f"{target}: {r.runs} inputs run, fewer than its {seeds} seeds"
