"""How Fathom's web process is started, in one place for `make run`, the tests and the benches.

uvicorn with uvloop and httptools serves HTTP and websockets (Channels) from one ASGI app. Its C
parsers matter on the OpenAI endpoint, where every generated token is an SSE event relayed
through this process (bench.serving prints the web process's CPU per 1000 relayed tokens).
"""

from __future__ import annotations

import sys


def web_command(port: int, host: str = "127.0.0.1", *, access_log: bool = False) -> list[str]:
    """The command line of a web process on `host:port`; run it from the platform/ folder."""
    command = [
        sys.executable, "-m", "uvicorn", "controlplane.asgi:application",
        "--host", host, "--port", str(port),
        "--loop", "uvloop", "--http", "httptools", "--ws", "websockets",
        "--lifespan", "off",  # Channels' ProtocolTypeRouter has no lifespan handler
    ]  # fmt: skip
    if not access_log:
        command.append("--no-access-log")
    return command


if __name__ == "__main__":  # the container's entry: python -m controlplane.web [PORT]
    import os

    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    os.execv(sys.executable, web_command(port, "0.0.0.0", access_log=True))
