"""Every file of this repository that the README, docs/, a docstring or a comment names is
there, and the overhead bench's stage table measures functions that exist: a file that
moves fails here rather than leaving a reader (or a profile) pointed at nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from loadgen.bench.live.path import STEPS

ROOT = Path(__file__).resolve().parents[2]
TOPS = "ext_proc|emulator|loadgen|envoy|tests|docs|deploy"
EXTENSIONS = "py|md|yaml|yml|js|json|jsonl|proto|toml|sh|html|css|tsv|txt|lua"
# A path of ours: one of the top folders, then a file with a known extension.
NAMED = re.compile(rf"(?<![\w/.-])((?:{TOPS})/[\w/.-]*\.(?:{EXTENSIONS}))(?![\w/])")
# Envoy's own source tree shares two top names with ours.
ENVOY_SOURCE = ("docs/root/", "envoy/stream_info/", "envoy/config/", "envoy/extensions/")


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def sources() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "Makefile", ROOT / ".ci/run"]
    found += sorted((ROOT / "docs").rglob("*.md"))
    for top in ("ext_proc", "emulator", "loadgen", "tests", "deploy"):
        found += sorted(p for p in (ROOT / top).rglob("*") if p.suffix in {".py", ".js", ".md"})
    return [p for p in found if "_pb2" not in p.name and p.name != Path(__file__).name]


def exists(named: str) -> bool:
    # Inside ext_proc/ a module may be named from its package ("envoy/codec.py").
    return (ROOT / named).exists() or (ROOT / "ext_proc" / named).exists()


def placeholder(named: str) -> bool:
    stem = Path(named).stem
    return stem.isupper() or named.startswith(ENVOY_SOURCE)


def test_every_file_the_repository_names_exists() -> None:
    missing = sorted(
        f"{path.relative_to(ROOT)}: {named}"
        for path in sources()
        for named in NAMED.findall(read(path))
        if not placeholder(named) and not exists(named)
    )
    assert not missing, "named but not there:\n" + "\n".join(missing)


def test_the_path_test_sees_a_moved_file() -> None:
    text = "see `ext_proc/core/nowhere.py` and ext_proc/envoy/server.py, envoy/codec.py."
    named = NAMED.findall(text)
    assert named == ["ext_proc/core/nowhere.py", "ext_proc/envoy/server.py", "envoy/codec.py"]
    assert [exists(n) for n in named] == [False, True, True]


@pytest.mark.parametrize(("label", "suffix", "func"), [s[:3] for s in STEPS])
def test_each_stage_of_the_overhead_table_is_a_function_there(
    label: str, suffix: str, func: str
) -> None:
    files = [p for p in (ROOT / "ext_proc").rglob("*.py") if p.as_posix().endswith(suffix)]
    defined = [p for p in files if re.search(rf"def {func}\b", read(p))]
    assert defined, f"{label!r}: no def {func} in a file ending {suffix}"


# A dotted name of ours, e.g. ext_proc.envoy_config.xds.write_xds: its module part must import.
DOTTED = re.compile(r"(?<![\w.])((?:ext_proc|emulator|loadgen)(?:\.[a-z_]\w*)+)")


SERVICE_OBJECT = (
    "ext_proc.tokens",
    "ext_proc.director",
    "ext_proc.active_streams",
    "ext_proc.prefill_legs",
)


def names_a_module(dotted: str) -> bool:
    """The name's longest importable prefix leaves at most one attribute after it."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        path = ROOT.joinpath(*parts[:i])
        if path.with_suffix(".py").exists() or (path / "__init__.py").exists():
            return i >= len(parts) - 1
    return False


def test_every_module_the_code_names_in_prose_exists() -> None:
    missing = sorted(
        f"{path.relative_to(ROOT)}: {dotted}"
        for path in sources()
        if path.suffix in {".py", ".md"}
        for dotted in DOTTED.findall(read(path))
        # `ext_proc` is also the name of the service object in two tests and app.py
        if not dotted.startswith(SERVICE_OBJECT) and not names_a_module(dotted)
    )
    assert not missing, "named but not there:\n" + "\n".join(missing)
