"""`/ws/deployments/<id>/`: a deployment's lifecycle and serving metrics, history then live."""

from __future__ import annotations

from controlplane.streams import EventStreamConsumer
from deployments import services
from deployments.models import Deployment


class DeploymentConsumer(EventStreamConsumer):
    url_kwarg = "deployment_id"
    model = Deployment

    def group_for(self, object_id: int) -> str:
        return services.group(object_id)
