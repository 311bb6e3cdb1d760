"""Websocket authentication: the browser's session cookie, or an API token for scripts.

Scripts send `Authorization: Token <key>` in the handshake headers (the CLI's `runs watch`
does); browsers cannot set headers on a websocket, so they rely on the session cookie.
"""

from __future__ import annotations

from typing import Any

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from django.contrib.auth.models import AnonymousUser
from rest_framework.authtoken.models import Token


@database_sync_to_async
def _user_for_token(key: str) -> Any:
    try:
        return Token.objects.select_related("user").get(key=key).user
    except Token.DoesNotExist:
        return AnonymousUser()


class _TokenAuthMiddleware:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        headers = dict(scope.get("headers", []))
        auth = headers.get(b"authorization", b"").decode()
        if auth.startswith("Token "):
            scope = dict(scope, user=await _user_for_token(auth.removeprefix("Token ").strip()))
        return await self.inner(scope, receive, send)


def TokenOrSessionAuthMiddleware(inner: Any) -> Any:  # noqa: N802 (named like Channels' stacks)
    # The session stack runs first and sets scope["user"]; a token, when present, wins.
    return AuthMiddlewareStack(_TokenAuthMiddleware(inner))
