"""The last good config: a copy of the config the router runs, kept so that a restart with
a broken file on disk (an edit a reload refused, then a crash) starts from what last
worked instead of exiting and leaving Envoy without its router.

`gorgo serve --last-good-config PATH` writes the config text it runs to PATH (atomically)
after every start and every accepted reload. When `--config FILE` does not load at start
and PATH does, the router starts from PATH, logs an error naming FILE and why, and shows
it on /state (`config: {source: "last-good", error: ...}`); the reloader keeps watching
FILE, so a fixed file (or a SIGHUP) is tried again and, accepted, becomes the running
config. Without PATH, or with nothing loadable in it, a broken FILE fails the start as it
always did (exit 2).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ext_proc.common.files import write_atomic
from ext_proc.config.load import read_config
from ext_proc.config.schema import Config
from ext_proc.vocab.params import ConfigError

log = logging.getLogger("gorgo")

FILE, LAST_GOOD = "file", "last-good"


@dataclass
class ConfigSource:
    """Where the running config came from (/state `config`), and the last good copy."""

    path: str  # --config
    last_good: Path | None = None  # --last-good-config
    source: str = FILE
    # Why `path` is not what runs (source last-good): the loader's message.
    error: str = ""

    def running(self, text: str) -> None:
        """The config loaded from `text` (the file's, start or accepted reload) runs now:
        keep it as the last good one."""
        self.source, self.error = FILE, ""
        if self.last_good is None:
            return
        try:
            write_atomic(self.last_good, text)
        except OSError as e:  # the router runs on; only the fallback is missing
            log.warning("cannot write the last good config to %s: %s", self.last_good, e)

    def snapshot(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "source": self.source,
            "error": self.error or None,
            "last_good": str(self.last_good) if self.last_good is not None else None,
        }


def load_starting_config(path: str, last_good: str | None) -> tuple[Config, str, ConfigSource]:
    """The config to start with, its text, and its source: `path`'s, else (it does not
    load) the last good copy's. Raises ConfigError (the file's own) when neither loads."""
    source = ConfigSource(path, Path(last_good) if last_good else None)
    try:
        cfg, text = read_config(path)
        return cfg, text, source
    except ConfigError as e:
        if source.last_good is None or not source.last_good.exists():
            raise
        error = e
    try:
        cfg, text = read_config(source.last_good)
    except ConfigError as e:
        log.error("the last good config %s does not load either: %s", source.last_good, e)
        raise error from None
    source.source, source.error = LAST_GOOD, str(error)
    log.error(
        "config %s does not load (%s): starting from the last good config %s; fix the file "
        "and send SIGHUP (or just save it) to load it",
        path,
        error,
        source.last_good,
    )
    return cfg, text, source


__all__ = ["FILE", "LAST_GOOD", "ConfigSource", "load_starting_config"]
