"""What runs: the router's package version (gorgo_build_info, the decision span's
resource)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# The distribution's name (pyproject.toml [project] name).
DISTRIBUTION = "gorgo-router"


def package_version() -> str:
    """The installed package's version; "unknown" when run from a tree never installed."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"
