"""A TCP proxy that passes bytes through and reads none of them: the floor of any relay.

    python -m bench.byte_proxy UPSTREAM_HOST UPSTREAM_PORT PORT

bench.serving puts it on the routers' core, scheduled as they are (`serving.app.relay_scheduling`),
so a burst through it costs what one more hop on that core costs, whatever the hop does: the
relays' figures are read against it. Each client connection gets its own upstream connection,
opened when the client connects; what the client sends before that is held and sent first.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import cast

import uvloop

from serving.app import relay_scheduling


class _Upstream(asyncio.Protocol):
    def __init__(self, client: asyncio.Transport) -> None:
        self._client = client

    def data_received(self, data: bytes) -> None:
        self._client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._client.close()


class _Client(asyncio.Protocol):
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self._address = (upstream_host, upstream_port)
        self._upstream: asyncio.Transport | None = None
        self._held: list[bytes] = []
        self._closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # cast, not isinstance: uvloop's transports do not derive from asyncio's classes.
        asyncio.get_running_loop().create_task(self._connect(cast(asyncio.Transport, transport)))

    async def _connect(self, transport: asyncio.Transport) -> None:
        try:
            upstream, _ = await asyncio.get_running_loop().create_connection(
                lambda: _Upstream(transport), *self._address
            )
        except OSError:
            transport.close()
            return
        if self._closed:
            upstream.close()
            return
        for data in self._held:
            upstream.write(data)
        self._held.clear()
        self._upstream = upstream

    def data_received(self, data: bytes) -> None:
        if self._upstream is None:
            self._held.append(data)
        else:
            self._upstream.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        if self._upstream is not None:
            self._upstream.close()


async def serve(upstream_host: str, upstream_port: int, port: int) -> None:
    server = await asyncio.get_running_loop().create_server(
        lambda: _Client(upstream_host, upstream_port), "127.0.0.1", port, backlog=1024
    )
    await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("upstream_host")
    parser.add_argument("upstream_port", type=int)
    parser.add_argument("port", type=int)
    args = parser.parse_args()
    relay_scheduling()
    uvloop.run(serve(args.upstream_host, args.upstream_port, args.port))


if __name__ == "__main__":
    main()
