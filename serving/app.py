"""A standalone OpenAI endpoint over one deployment: a bare ASGI app around `Gateway`.

Fathom's web process serves `/v1/...` through Django; this app is for a replica host without
the control plane, and for benchmarks that compare routed against direct traffic:

    python -m serving.app --state-dir STATE_DIR --port 8000

It routes to the routable replicas of the supervisor's state file (`serving.state`) and runs on uvicorn with
uvloop and httptools: this process does nothing but relay, and their C parsers and event loop
relay a token for less CPU than a pure-Python HTTP server.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from serving.gateway import Gateway, deployment_gateway
from serving.openai_requests import unknown_endpoint
from serving.router import ProxyResponse, error_response
from serving.state import DeploymentDir

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def read_body(receive: Receive) -> bytes:
    """The whole request body of an ASGI HTTP request."""
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def send_json(send: Send, status: int, data: Any) -> None:
    await send_response(send, ProxyResponse(status, "application/json", json.dumps(data).encode()))


async def send_response(send: Send, response: ProxyResponse, receive: Receive | None = None) -> None:
    """Send a gateway's answer over ASGI, streaming it chunk by chunk when it is a stream.

    With `receive` (the request body already read), a stream stops as soon as the client hangs
    up: the server then drops what is sent (uvicorn does so silently), and the replica would
    otherwise go on generating for nobody."""
    headers = [(b"content-type", response.content_type.encode())]
    if response.replica:
        headers.append((b"x-fathom-replica", response.replica.encode()))
    if response.stream is not None:
        headers.append((b"cache-control", b"no-cache"))
    headers += [(name.encode(), value.encode()) for name, value in response.headers.items()]
    try:
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        if response.stream is None or receive is None:
            await _send_body(send, response)
            return
        body = asyncio.ensure_future(_send_body(send, response))
        hang_up = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({body, hang_up}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hang_up.cancel()
            body.cancel()
        if body.done() and not body.cancelled():
            body.result()  # re-raises what went wrong while sending
    finally:
        # However this ends (a client that hung up, a cancelled task), end the upstream request
        # and free its routing slot; closing twice is harmless.
        if response.stream is not None:
            await response.stream.aclose()


async def _send_body(send: Send, response: ProxyResponse) -> None:
    if response.stream is None:
        await send({"type": "http.response.body", "body": response.body or b""})
        return
    # The relay itself, not `iter_bytes`: a generator layer less per event (`send_response`
    # closes the relay however the stream ends).
    async for chunk in response.stream:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def create_app(gateway: Gateway) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await gateway.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if method == "GET" and path == "/health":
            await send_json(send, 200, {"status": "ok"})
        elif method == "GET" and path == "/v1/models":
            await send_json(send, 200, gateway.models())
        elif method == "POST":
            await send_response(send, await gateway.handle(path, await read_body(receive)), receive)
        else:
            await send_response(send, error_response(unknown_endpoint(path)))

    return app


def relay_scheduling() -> None:
    """Schedule this process (and the threads it starts later) as Linux's SCHED_BATCH.

    A relay is woken for every request and every token event it passes on. Under the default
    policy each wakeup preempts whatever runs on its core (a client, a Celery task, Postgres), so
    a burst becomes a ping-pong of context switches in which neither side gets far: in
    bench.serving's burst of 100 chats, with the client on the relay's core, the relay's
    forwards reached vLLM spread over 17–38 ms against the client's own 4–13 ms, and first tokens
    came 30–60% later than direct. A batch task is not run ahead of the running task at wakeup:
    it runs at the next switch (the running task blocks or its slice of a few ms ends) and then
    relays everything that arrived meanwhile in one go. Its share of the CPU is unchanged (nice
    0); on a core of its own nothing changes. A no-op where the policy does not exist."""
    if hasattr(os, "SCHED_BATCH"):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


def freeze_startup_objects() -> None:
    """Keeps what a relay built at start-up out of Python's garbage collector.

    Modules, classes and the app (tens of thousands of objects: 40,000 in this process, about
    100,000 in the web process with Django) live as long as the process. A full collection walks
    them all, holding the GIL throughout (26 ms here; 170 ms in the web process, once, in the
    middle of bench.live_metrics' 1,000 points/s), and the allocations of requests can set one
    off at any moment. Frozen, they are skipped; what requests allocate is still collected."""
    gc.collect()
    gc.freeze()


def app_for_deployment(state_dir: str | Path) -> ASGIApp:
    """An app routing to the deployment whose supervisor writes to `state_dir`."""
    from serving.deployment_config import DeploymentConfig

    config = DeploymentConfig.from_dict(json.loads(DeploymentDir(Path(state_dir)).config_file.read_text()))
    gateway = deployment_gateway(
        name=config.name, max_model_len=config.options.max_model_len, checkpoint=config.export, state_dir=state_dir,
        routing=config.routing,
    )
    return create_app(gateway)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve one deployment's OpenAI endpoint.")
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    import logging

    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    relay_scheduling()
    app = app_for_deployment(args.state_dir)
    freeze_startup_objects()
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,  # one line per proxied request otherwise
        log_level="warning",
    )


if __name__ == "__main__":
    main()
