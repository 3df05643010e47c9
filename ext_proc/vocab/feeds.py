"""What a feed's running loop is: something that reads the fleet from outside (probes,
engine metrics and model lists, KV events, other routers) and tells the router. Started
once, told of each backend as it is added or removed, stopped once; the service's fleet
shell drives every feed alike (`ext_proc/service/loops/` has them)."""

from __future__ import annotations

import asyncio
from typing import Protocol

from ext_proc.vocab.backend import Backend


class Feed(Protocol):
    """A feed's running loop as the fleet shell drives it: started once, told of each
    backend added or removed, stopped once."""

    # Its name in /state's fleet_shell section.
    name: str

    async def start(self) -> None:
        """Start, for every backend of the config it was built with."""
        ...

    def add(self, backend: Backend) -> None:
        """Read `backend` from now on (nothing, for a feed that is not per backend). Any
        earlier tasks for it were cancelled and have ended (`cancel`)."""
        ...

    def cancel(self, backend: str) -> list[asyncio.Task[None]]:
        """Stop reading `backend`: its tasks, cancelled now, to be awaited."""
        ...

    @property
    def backends(self) -> list[str]:
        """The backends it reads now."""
        ...

    async def stop(self) -> None: ...
