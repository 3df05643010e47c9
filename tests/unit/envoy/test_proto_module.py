"""The generated protobuf module is committed (every install ships it; nothing compiles it
at build time), so two things must hold: it is what `make proto` makes of envoy_wire.proto
today, and the router's protobuf floor (pyproject `dependencies`) is the version of the
protoc that generated it, since the module refuses an older runtime at import."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROTO_DIR = ROOT / "ext_proc" / "envoy" / "proto"
GENERATED = ("envoy_wire_pb2.py", "envoy_wire_pb2.pyi")


def make_proto_args() -> list[str]:
    """`make proto`'s protoc arguments, read from the Makefile (PROTO_SRC spelled out)."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"-m grpc_tools\.protoc (.+?)\$\(PROTO_SRC\)", makefile, re.S)
    source = re.search(r"^PROTO_SRC := (\S+)$", makefile, re.M)
    assert recipe is not None and source is not None, "make proto's recipe not found"
    return [*recipe.group(1).replace("\\\n", " ").split(), source.group(1)]


def test_the_committed_module_is_what_make_proto_generates(tmp_path: Path) -> None:
    args = [
        f"{a.partition('=')[0]}={tmp_path}" if re.match(r"--\w+_out=", a) else a
        for a in make_proto_args()
    ]
    assert sum(a.endswith(f"={tmp_path}") for a in args) == 2  # --python_out, --pyi_out
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", *args],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=60,
    )
    stale = [
        name
        for name in GENERATED
        if (tmp_path / name).read_bytes() != (PROTO_DIR / name).read_bytes()
    ]
    assert not stale, (
        f"ext_proc/envoy/proto/{stale} differ from what envoy_wire.proto generates: "
        "run `make proto` and commit the generated files"
    )


def test_the_protobuf_floor_is_the_version_that_generated_the_module() -> None:
    text = (PROTO_DIR / "envoy_wire_pb2.py").read_text()
    check = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,"
        r"\s*(\d+),\s*(\d+),\s*(\d+),",
        text,
    )
    assert check is not None, "the module no longer checks the runtime's version"
    generated_by = ".".join(check.groups())
    assert f"# Protobuf Python Version: {generated_by}\n" in text
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floor = [d for d in project["dependencies"] if re.match(r"protobuf\b", d)]
    assert floor == [f"protobuf>={generated_by}"]
