"""The rivals' venv check and the errors that name `make peers` (emulator/rivals/install.py);
the install itself runs in the peers tier (make test-peers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from emulator.rivals.install import (
    REQUIREMENTS,
    STAMP_NAME,
    RivalsNotInstalled,
    is_installed,
    rival_binary,
)


def fake_venv(root: Path, requirements: list[str], tools: tuple[str, ...]) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").touch()
    for tool in tools:
        (root / "bin" / tool).touch()
    (root / STAMP_NAME).write_text(json.dumps({"requirements": requirements}))
    return root


def test_a_finished_install_with_the_pins(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path / "v", list(REQUIREMENTS), ("smg", "vllm-router"))
    assert is_installed(venv)
    assert rival_binary("smg", venv) == venv / "bin" / "smg"


def test_other_pins_or_a_missing_tool_is_not_installed(tmp_path: Path) -> None:
    assert not is_installed(tmp_path / "none")
    old = fake_venv(tmp_path / "old", ["smg==1.9.0", "vllm-router==0.1.10"], ("smg", "vllm-router"))
    assert not is_installed(old)
    half = fake_venv(tmp_path / "half", list(REQUIREMENTS), ("smg",))
    assert not is_installed(half)
    with pytest.raises(RivalsNotInstalled, match="make peers"):
        rival_binary("vllm-router", half)


def test_unknown_tool(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'envoy'"):
        rival_binary("envoy", tmp_path)
