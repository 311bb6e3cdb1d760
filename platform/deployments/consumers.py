"""`/ws/deployments/<id>/`: a deployment's lifecycle and serving metrics, history then live."""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from deployments import services
from deployments.models import Deployment


class DeploymentConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        user = self.scope.get("user")
        deployment_id = int(self.scope["url_route"]["kwargs"]["deployment_id"])
        if not await _owns(user, deployment_id):
            await self.close(code=4404)
            return
        self.group = services.group(deployment_id)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        history = await _history(deployment_id)
        if history:
            await self.send_json({"type": "events", "events": history})

    async def disconnect(self, code: int) -> None:
        if hasattr(self, "group"):
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def deployment_events(self, message: dict[str, Any]) -> None:
        await self.send_json({"type": "events", "events": message["events"]})


@database_sync_to_async
def _owns(user: Any, deployment_id: int) -> bool:
    return bool(user and user.is_authenticated and Deployment.objects.filter(pk=deployment_id, owner=user).exists())


@database_sync_to_async
def _history(deployment_id: int) -> list[dict[str, Any]]:
    events = Deployment.objects.get(pk=deployment_id).events.order_by("-seq")[:500]
    return [e.as_message() for e in reversed(list(events))]
