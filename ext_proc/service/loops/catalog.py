"""Feeds beyond the built-in loops, by name: a module with a `Feed` class decorated with
`@register_feed("name")` (a factory of (config, router)), imported here, is started with
the service, told of each backend as it comes and goes (the fleet shell), shown in
/state's fleet_shell section and stopped with the service (docs/architecture.md, "Adding
a feed"). The built-in loops (probe, kv_client, fleet_bus) are wired by the composition
root itself: it needs each of them by name (probes first, before /healthz)."""

from __future__ import annotations

from collections.abc import Callable

from ext_proc.config.schema import Config
from ext_proc.core.router import Router
from ext_proc.vocab.feeds import Feed

FeedFactory = Callable[[Config, Router], Feed]

FEEDS: dict[str, FeedFactory] = {}


def register_feed(name: str) -> Callable[[FeedFactory], FeedFactory]:
    def add(factory: FeedFactory) -> FeedFactory:
        if name in FEEDS:
            raise ValueError(f"feed {name!r} registered twice")
        FEEDS[name] = factory
        return factory

    return add


def unregister_feed(name: str) -> None:
    """Forget a feed (a test's own)."""
    FEEDS.pop(name, None)
