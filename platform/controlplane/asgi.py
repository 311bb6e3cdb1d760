"""ASGI entry (`uvicorn controlplane.asgi:application`): websockets through Channels, the OpenAI
endpoint under /v1/ as a bare ASGI app (deployments/openai_endpoint.py says why), other HTTP through Django."""

import os
import sys
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

# The repo root holds training/ and serving/; platform/ holds the Django project and apps.
for _folder in (Path(__file__).resolve().parents[2], Path(__file__).resolve().parents[1]):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

from django.core.asgi import get_asgi_application

# Django must be set up before the consumers (and the models they import) are loaded.
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter
from channels.security.websocket import AllowedHostsOriginValidator

from accounts.websocket import TokenOrSessionAuthMiddleware
from controlplane.observability_asgi import count_websockets, observe_http
from controlplane.routing import websocket_urlpatterns
from deployments.openai_endpoint import openai_endpoint


async def http_application(
    scope: dict[str, Any],
    receive: Callable[[], Awaitable[dict[str, Any]]],
    send: Callable[[Mapping[str, Any]], Awaitable[None]],
) -> None:  # typed as Django's ASGIHandler wants; the OpenAI endpoint accepts the same
    if scope["path"].startswith("/v1/"):
        await openai_endpoint(scope, receive, send)
    else:
        await django_asgi_app(scope, receive, send)


# The observers wrap everything, so what they measure is what clients get (request ids, /v1
# metrics, 5xx counts, websocket clients: controlplane/observability_asgi.py).
application = ProtocolTypeRouter(
    {
        "http": observe_http(http_application),
        "websocket": count_websockets(
            AllowedHostsOriginValidator(TokenOrSessionAuthMiddleware(URLRouter(websocket_urlpatterns)))
        ),
    }
)
