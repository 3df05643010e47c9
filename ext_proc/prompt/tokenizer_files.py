"""Where a served model's tokenizer files are on this machine: the model directory an
engine reports (`/v1/models` `root`: vLLM's and SGLang's model path), or the model's
snapshot in the Hugging Face cache when it reports a hub id, looked up with
huggingface_hub's own cache functions (the cache its settings name: `HF_HUB_CACHE`, else
`HF_HOME/hub`, else `~/.cache/huggingface/hub`). Nothing is downloaded.

Pure but for reading the file system.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants

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


def hub_cache() -> Path:
    """The Hugging Face hub cache huggingface_hub reads (its settings, as at import)."""
    return Path(constants.HF_HUB_CACHE)


def hub_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot of hub model `repo_id` that holds a tokenizer.json: the one its
    `main` ref names, else the newest cached revision (a model fetched at a pinned commit
    has no ref)."""
    # huggingface_hub's file functions load its HTTP client (~70 ms): only when asked.
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, TOKENIZER_JSON, cache_dir=hub_cache())
    except ValueError:  # not a name the hub takes
        return None
    if isinstance(found, str):
        return Path(found).parent
    if not hub_cache().is_dir():
        return None
    cache = scan_cache_dir(hub_cache())
    snapshots = [
        rev
        for repo in cache.repos
        if repo.repo_id == repo_id and repo.repo_type == "model"
        for rev in repo.revisions
        if (rev.snapshot_path / TOKENIZER_JSON).is_file()
    ]
    newest = max(snapshots, key=lambda rev: rev.last_modified, default=None)
    return None if newest is None else newest.snapshot_path


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
            candidates += [s for s in [hub_snapshot(name)] if s is not None]
        for d in candidates:
            cfg = tokenizer_config_of(d, cache_entries)
            if cfg is not None:
                return Found(cfg, str(d))
        looked.append(name)
    return Found(
        None,
        f"no tokenizer.json with a chat template for {' or '.join(map(repr, looked))} "
        f"(looked in the model directory and the Hugging Face cache {hub_cache()})",
    )
