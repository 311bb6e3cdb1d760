from django.urls import include, path
from rest_framework.routers import DefaultRouter

from hosts.views import HeartbeatView, HostViewSet

router = DefaultRouter(trailing_slash=True)
router.register("hosts", HostViewSet, basename="host")

urlpatterns = [
    path("hosts/heartbeat/", HeartbeatView.as_view(), name="host-heartbeat"),
    path("", include(router.urls)),
]
