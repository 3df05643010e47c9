"""Where a served model's tokenizer is found: its model directory, or its snapshot in a
Hugging Face cache laid out as the hub lays it out (models--ORG--NAME/ with blobs/ named
by content hash, snapshots/COMMIT/ of links to them, refs/main naming the commit), the
cache huggingface_hub's settings name (HF_HUB_CACHE, else HF_HOME/hub)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

from ext_proc.prompt.tokenizer_files import find_tokenizer, hub_cache, hub_snapshot

REPO = "acme/tiny-chat"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
FILES = {
    "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "WordLevel"}}),
    "tokenizer_config.json": json.dumps({"chat_template": TEMPLATE}),
}


def lay_out(
    cache: Path, repo_id: str, commit: str, files: dict[str, str], ref: str | None = "main"
) -> Path:
    """One revision of a model repo in the hub cache's layout; its snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, text in files.items():
        blob = repo / "blobs" / hashlib.sha256(text.encode()).hexdigest()
        blob.write_text(text)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache, the one huggingface_hub reads in this process."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_a_hub_id_finds_the_snapshot_main_names(cache: Path) -> None:
    old = lay_out(cache, REPO, "a" * 40, FILES, ref=None)
    main = lay_out(cache, REPO, "b" * 40, FILES)
    os.utime(old, (4e9, 4e9))  # newer on disk: main wins all the same
    found = find_tokenizer(["/models/not-here", REPO], 64)
    assert found.config is not None and found.where == str(main)
    assert found.config.path == str(main / "tokenizer.json") and found.config.chat_template == ""
    assert Path(found.config.path).read_text() == FILES["tokenizer.json"]  # through the link


def test_without_a_main_ref_the_newest_cached_revision(cache: Path) -> None:
    """A model fetched at a pinned commit: no ref names it."""
    lay_out(cache, REPO, "a" * 40, FILES, ref=None)
    newer = lay_out(cache, REPO, "c" * 40, {**FILES, "tokenizer.json": "{}"}, ref=None)
    for blob in (newer.parent.parent / "blobs").iterdir():
        if blob.read_text() == "{}":
            os.utime(blob, (4e9, 4e9))
    assert hub_snapshot(REPO) == newer
    # main naming a revision without a tokenizer.json: the newest one that has it
    lay_out(cache, REPO, "d" * 40, {"config.json": "{}"})
    assert hub_snapshot(REPO) == newer


def test_a_template_beside_as_chat_template_jinja(cache: Path) -> None:
    files = {"tokenizer.json": "{}", "chat_template.jinja": TEMPLATE}
    snap = lay_out(cache, REPO, "e" * 40, files)
    found = find_tokenizer([REPO], 8)
    assert found.config is not None
    assert found.config.chat_template == str(snap / "chat_template.jinja")


def test_nothing_found_says_which_cache_it_looked_in(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lay_out(cache, REPO, "f" * 40, {"tokenizer.json": "{}"})  # no chat template
    lay_out(cache, "acme/other", "f" * 40, FILES)
    found = find_tokenizer([REPO, "acme/missing"], 8)
    assert found.config is None
    assert "'acme/tiny-chat' or 'acme/missing'" in found.where and str(cache) in found.where
    assert hub_snapshot("acme/missing") is None and hub_cache() == cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache.with_name("nothing")))  # none
    assert hub_snapshot(REPO) is None and find_tokenizer([REPO], 8).config is None


FIND = (
    "import sys; from ext_proc.prompt.tokenizer_files import find_tokenizer; "
    "f = find_tokenizer([sys.argv[1]], 8); print(f.where if f.config else 'none: ' + f.where)"
)


@pytest.mark.parametrize("setting", ["HF_HUB_CACHE", "HF_HOME"])
def test_the_environment_names_the_cache_as_huggingface_hub_reads_it(
    tmp_path: Path, setting: str
) -> None:
    """A fresh process (huggingface_hub reads its settings at import), the cache named by
    HF_HUB_CACHE, or by HF_HOME (its hub/ folder)."""
    cache = tmp_path / "hub" if setting == "HF_HOME" else tmp_path / "elsewhere"
    snap = lay_out(cache, REPO, "9" * 40, FILES)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env[setting] = str(tmp_path if setting == "HF_HOME" else cache)
    out = subprocess.run(
        [sys.executable, "-c", FIND, REPO], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == str(snap)
