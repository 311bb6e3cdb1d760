"""Django's own 404 and 500 answers, in JSON under /api/ so API clients always get a body they parse.

DRF answers every error its views raise; these cover what happens before a view runs (a path
that matches no route, such as /api/runs/abc/) and what escapes it.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views import defaults

API_PREFIX = "/api/"


def not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    if request.path.startswith(API_PREFIX):
        return JsonResponse({"detail": "Not found."}, status=404)
    return defaults.page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    if request.path.startswith(API_PREFIX):
        return JsonResponse({"detail": "Server error."}, status=500)
    return defaults.server_error(request)
