"""The README's first screen says what GORGO is, gives the two commands and links the
own-fleet section; every link in the README and docs/ reaches a file, and its #anchor a
heading there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SCREEN_LINES = 40
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*_]", "", heading.strip().lstrip("#").strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text, fenced, out = path.read_text(), False, set()
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        if not fenced and line.startswith("#"):
            out.add(slug(line))
    return out


def test_the_first_screen_has_what_the_two_commands_and_the_own_fleet_link() -> None:
    screen = "\n".join(README.splitlines()[:SCREEN_LINES])
    what = screen.split("\n\n")[1]  # the paragraph under the title
    assert len(re.findall(r"[.!?](\s|$)", what)) <= 3, what
    assert "make demo" in screen and "make test" in screen
    assert "(#put-it-in-front-of-your-fleet)" in screen
    assert "put-it-in-front-of-your-fleet" in anchors(ROOT / "README.md")


def test_every_link_reaches_a_file_and_its_anchor_a_heading() -> None:
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(doc.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append((doc.name, target, "no such file"))
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append((doc.name, target, "no such heading"))
    assert not broken, broken
