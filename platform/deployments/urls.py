from django.urls import include, path
from rest_framework.routers import DefaultRouter

from deployments.openai_endpoint import playground_chat
from deployments.views import AdapterViewSet, ApiKeyViewSet, DeploymentViewSet, ShippedFolderView

router = DefaultRouter(trailing_slash=True)
router.register("deployments", DeploymentViewSet, basename="deployment")
router.register(r"deployments/(?P<deployment_id>[0-9]+)/keys", ApiKeyViewSet, basename="deployment-key")
router.register(r"deployments/(?P<deployment_id>[0-9]+)/adapters", AdapterViewSet, basename="deployment-adapter")

urlpatterns = [
    path("deployments/<int:deployment_id>/chat/", playground_chat, name="deployment-chat"),
    path("deployments/<int:deployment_id>/shipped/", ShippedFolderView.as_view(), name="deployment-shipped"),
    path("", include(router.urls)),
]
