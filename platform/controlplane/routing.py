from django.urls import path

from deployments.consumers import DeploymentConsumer
from runs.consumers import RunConsumer

websocket_urlpatterns = [
    path("ws/runs/<int:run_id>/", RunConsumer.as_asgi()),
    path("ws/deployments/<int:deployment_id>/", DeploymentConsumer.as_asgi()),
]
