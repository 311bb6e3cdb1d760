"""`/ws/deployments/<id>/`: a deployment's lifecycle and serving metrics, history then live."""

from __future__ import annotations

from typing import Any

from controlplane.streams import EventStreamConsumer
from deployments import services
from deployments.models import Deployment


class DeploymentConsumer(EventStreamConsumer):
    url_kwarg = "deployment_id"

    def load_owned(self, user: Any, object_id: int) -> Deployment | None:
        if user is None or not user.is_authenticated:
            return None
        return Deployment.objects.filter(pk=object_id, owner=user).first()

    def group_for(self, object_id: int) -> str:
        return services.group(object_id)

    def events_after(self, subject: Deployment, after: int, limit: int) -> list[dict[str, Any]]:
        return [e.as_message() for e in subject.events.filter(seq__gt=after).order_by("seq")[:limit]]
