from django.urls import include, path
from rest_framework.routers import DefaultRouter

from deployments.views import DeploymentViewSet

router = DefaultRouter(trailing_slash=True)
router.register("deployments", DeploymentViewSet, basename="deployment")

urlpatterns = [path("", include(router.urls))]
