from django.urls import path

from accounts.views import MeView, TokenView

urlpatterns = [
    path("auth/token/", TokenView.as_view(), name="api-token"),
    path("me/", MeView.as_view(), name="api-me"),
]
