from django.urls import include, path
from rest_framework.routers import DefaultRouter

from notifications.views import WebhookViewSet

router = DefaultRouter(trailing_slash=True)
router.register("webhooks", WebhookViewSet, basename="webhook")

urlpatterns = [path("", include(router.urls))]
