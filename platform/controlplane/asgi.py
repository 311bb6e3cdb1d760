"""ASGI entry: HTTP through Django, websockets through Channels (`daphne controlplane.asgi:application`)."""

import os
import sys
from pathlib import Path

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
from controlplane.routing import websocket_urlpatterns

application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": AllowedHostsOriginValidator(TokenOrSessionAuthMiddleware(URLRouter(websocket_urlpatterns))),
    }
)
