"""The tuner's state file: the weights and history survive a restart (written after every
step, atomically, off the event loop).
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ext_proc.common.files import write_atomic
from ext_proc.learn.settings import TunerSettings, TunerState, state_from_doc

log = logging.getLogger("gorgo")


class TunerStateFile:
    """Persists the tuner's state (tuner.state_file): restored at start; each new state
    written atomically by one worker thread, in order, off the event loop."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tuner-state")

    def load(self, settings: TunerSettings) -> TunerState | None:
        if not self.path.exists():
            return None
        try:
            state = state_from_doc(json.loads(self.path.read_text()), settings)
        except (ValueError, OSError) as e:
            log.error(
                "tuner state %s is corrupt (%s): starting from the configured weights",
                self.path,
                e,
            )
            return None
        if state is None:
            log.warning("tuner state %s is for another mode: starting from config", self.path)
        return state

    def save(self, doc: dict[str, Any]) -> None:
        self._writer.submit(write_atomic, self.path, json.dumps(doc))

    def close(self) -> None:
        self._writer.shutdown(wait=True)
