"""Where a served model's tokenizer files are on this machine: the model directory an
engine reports (`/v1/models` `root`: vLLM's and SGLang's model path), or the model's
snapshot in the Hugging Face cache when it reports a hub id. Nothing is downloaded.

Pure but for reading the file system.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ext_proc.prompt.chat_template import TOKENIZER_CONFIG, ChatTemplateError, template_in_config
from ext_proc.prompt.tokenizer_config import TokenizerConfig

TOKENIZER_JSON = "tokenizer.json"
# transformers (since 4.43) may save the template beside the config instead of in it.
TEMPLATE_FILE = "chat_template.jinja"


@dataclass(frozen=True)
class Found:
    """A tokenizer found (config to load it with), or why none was (config None)."""

    config: TokenizerConfig | None
    where: str


def hub_caches() -> list[Path]:
    """The Hugging Face hub caches, in the order huggingface_hub reads its settings."""
    out = []
    if os.environ.get("HF_HUB_CACHE"):
        out.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        out.append(Path(os.environ["HF_HOME"]) / "hub")
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    out.append(Path(xdg) / "huggingface" / "hub")
    return out


def _snapshot(cache: Path, repo_id: str) -> Path | None:
    """The snapshot of `repo_id` its `main` ref names, else the newest one."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if ref.is_file():
        snap = repo / "snapshots" / ref.read_text().strip()
        if (snap / TOKENIZER_JSON).is_file():
            return snap
    snaps = [p for p in (repo / "snapshots").glob("*") if (p / TOKENIZER_JSON).is_file()]
    return max(snaps, key=lambda p: p.stat().st_mtime) if snaps else None


def tokenizer_config_of(directory: Path, cache_entries: int) -> TokenizerConfig | None:
    """The config that loads a model directory's tokenizer and chat template (None: it
    has no tokenizer.json or no template)."""
    path = directory / TOKENIZER_JSON
    if not path.is_file():
        return None
    beside = directory / TOKENIZER_CONFIG
    try:
        in_config = beside.is_file() and template_in_config(beside) is not None
    except ChatTemplateError:
        in_config = False
    if in_config:
        return TokenizerConfig(str(path), "", cache_entries)
    if (directory / TEMPLATE_FILE).is_file():
        return TokenizerConfig(str(path), str(directory / TEMPLATE_FILE), cache_entries)
    return None


def find_tokenizer(names: list[str], cache_entries: int) -> Found:
    """The first of `names` (a model path, then hub ids) whose tokenizer and template are
    here."""
    looked = []
    for name in dict.fromkeys(n for n in names if n):
        directory = Path(name).expanduser()
        candidates = [directory] if directory.is_absolute() or directory.is_dir() else []
        if name.count("/") == 1 and not directory.is_absolute():
            candidates += [s for c in hub_caches() if (s := _snapshot(c, name)) is not None]
        for d in candidates:
            cfg = tokenizer_config_of(d, cache_entries)
            if cfg is not None:
                return Found(cfg, str(d))
        looked.append(name)
    caches = ", ".join(str(c) for c in hub_caches())
    return Found(
        None,
        f"no tokenizer.json with a chat template for {' or '.join(map(repr, looked))} "
        f"(looked in the model directory and the Hugging Face caches {caches})",
    )
