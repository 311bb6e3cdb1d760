from django.urls import include, path
from rest_framework.routers import DefaultRouter

from hosts.views import HeartbeatView, HostViewSet, MyQuotaView, QueueView, QuotaViewSet

router = DefaultRouter(trailing_slash=True)
router.register("hosts", HostViewSet, basename="host")
router.register("quotas", QuotaViewSet, basename="quota")

urlpatterns = [
    path("hosts/heartbeat/", HeartbeatView.as_view(), name="host-heartbeat"),
    path("quota/", MyQuotaView.as_view(), name="my-quota"),
    path("queue/", QueueView.as_view(), name="queue"),
    path("", include(router.urls)),
]
