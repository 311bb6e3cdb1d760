from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/", include("accounts.urls")),
    path("api/", include("runs.urls")),
    path("api/", include("deployments.urls")),
    path("", include("dashboard.urls")),
]

handler404 = "controlplane.errors.not_found"
handler500 = "controlplane.errors.server_error"
