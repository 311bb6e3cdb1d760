from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from controlplane.observability import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    # Prometheus scrapes here with FATHOM_METRICS_TOKEN (controlplane/observability.py).
    path("metrics", metrics_view, name="metrics"),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/", include("accounts.urls")),
    path("api/", include("runs.urls")),
    path("api/", include("deployments.urls")),
    path("api/", include("hosts.urls")),
    path("api/", include("notifications.urls")),
    path("", include("dashboard.urls")),
]

handler404 = "controlplane.error_pages.not_found"
handler500 = "controlplane.error_pages.server_error"
