"""Every Python example in the README and docs/ runs, so the docs cannot rot: each file's
blocks run in order, in a fresh interpreter (an example may register a policy)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def python_blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text(encoding="utf-8"))


def test_the_docs_have_examples() -> None:
    assert python_blocks(ROOT / "docs" / "architecture.md")  # the plugin example


@pytest.mark.parametrize(
    "doc", [d for d in DOCS if python_blocks(d)], ids=lambda d: str(d.relative_to(ROOT))
)
def test_python_examples_run(doc: Path) -> None:
    code = "\n\n".join(python_blocks(doc))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, f"{doc.name}:\n{out.stderr}"
