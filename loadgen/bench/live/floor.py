"""The floor of `gorgo bench path`: the least a Python ext_proc service does behind the
generated Envoy config, on the same stack (grpc.aio + protobuf), measured the same way as
the router. Each routing stream gets CONTINUE for its headers and the first backend's
routing header for its body, then closes; an observing stream (the first response
chunk) and the access-log entries are read and dropped; `/healthz` answers 200.

    python -m loadgen.bench.live.floor --config gorgo.yaml

What the router costs above it is the router's own work; what the floor costs is the
price of the streams the design opens per request.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import yaml
from aiohttp import web

from ext_proc.common.names import HEADER_BACKEND
from ext_proc.envoy import codec
from ext_proc.envoy.server import rpc_handlers
from ext_proc.vocab.params import split_host_port


class Floor:
    def __init__(self, backend: str) -> None:
        self.headers = codec.bare_continue(codec.REQUEST_HEADERS)
        self.body = codec.continue_response(
            codec.REQUEST_BODY, {HEADER_BACKEND: backend}, clear_route_cache=True
        )
        self.entries = 0

    async def process(
        self, requests: AsyncIterator[codec.ProcessingRequest], context: Any
    ) -> AsyncIterator[codec.ProcessingResponse]:
        async for req in requests:
            phase = req.WhichOneof("request")
            if phase == codec.REQUEST_HEADERS:
                yield self.headers
            elif phase == codec.REQUEST_BODY:
                yield self.body
                return
            else:  # the observer's first chunk: nothing to answer
                return

    async def access_logs(
        self, messages: AsyncIterator[codec.StreamAccessLogsMessage], context: Any
    ) -> codec.StreamAccessLogsResponse:
        async for msg in messages:
            self.entries += len(msg.http_logs.log_entry)
        return codec.StreamAccessLogsResponse()


async def serve(config_path: str) -> None:
    with open(config_path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    floor = Floor(cfg["backends"][0]["id"])
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(rpc_handlers(floor.process, floor.access_logs))
    server.add_insecure_port(cfg["listen"]["grpc"])
    await server.start()
    app = web.Application()

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, port = split_host_port(cfg["listen"]["admin"], "listen.admin")
    await web.TCPSite(runner, host, port).start()
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the stack's gorgo.yaml")
    asyncio.run(serve(parser.parse_args().config))


if __name__ == "__main__":
    main()
