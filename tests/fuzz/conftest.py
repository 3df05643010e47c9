"""Every test under tests/fuzz is a fuzz test (short runs of the targets, each in its own
process), marked so whether or not its module says so."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.fspath).resolve().parents:
            item.add_marker(pytest.mark.fuzz)
