"""What every REST endpoint shares: strict paging, a 409 for a change the state refuses, the
caller's own objects and an event history page.

controlplane/schema.py documents both; DRF's settings name this module, so it imports nothing
that imports DRF's views (that would be circular).
"""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models import QuerySet
from rest_framework import exceptions, serializers
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response

# The largest page a list answers. The dashboard asks for 100 rows; larger pages only let one
# request read a whole table (and a limit past SQLite's 64-bit LIMIT used to be a 500).
MAX_PAGE = 1000


def _query_int(request: Request, name: str, default: int, low: int, high: int | None = None) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    allowed = f"an integer from {low} to {high}" if high is not None else f"an integer ≥ {low}"
    try:
        value = int(raw)
    except ValueError:
        raise exceptions.ValidationError({name: [f"must be {allowed}; got {raw!r}"]}) from None
    if value < low or (high is not None and value > high):
        raise exceptions.ValidationError({name: [f"must be {allowed}; got {value}"]})
    return value


class Pagination(LimitOffsetPagination):
    """`?limit=&offset=` paging that refuses, naming the parameter, what it cannot honour."""

    default_limit = 100
    max_limit = MAX_PAGE

    def get_limit(self, request: Request) -> int:
        return _query_int(request, self.limit_query_param, self.default_limit, 1, self.max_limit)

    def get_offset(self, request: Request) -> int:
        return _query_int(request, self.offset_query_param, 0, 0)

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        parameters = super().get_schema_operation_parameters(view)
        bounds = {self.limit_query_param: {"minimum": 1, "maximum": self.max_limit}, self.offset_query_param: {"minimum": 0}}
        for parameter in parameters:
            parameter["schema"].update(bounds.get(parameter["name"], {}))
        return parameters


class Conflict(exceptions.APIException):
    """A change the object's current state does not allow (cancelling a finished run, say).

    The body keeps the shape of a field error, `{"status": ["…"]}`, so a client shows it the way
    it shows any other refusal.
    """

    status_code = 409
    default_code = "conflict"

    def __init__(self, field: str, message: str) -> None:
        super().__init__({field: [message]})


class Text(serializers.CharField):
    """A string field that takes only strings: DRF's CharField turns 0 or true into "0" or "True",
    which the schema (type: string) does not allow."""

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return str(super().to_internal_value(data))


class ModelSerializer(serializers.ModelSerializer):
    """DRF's ModelSerializer, with the model's text columns read as `Text`."""

    serializer_field_mapping = {
        **serializers.ModelSerializer.serializer_field_mapping,
        models.CharField: Text,
        models.TextField: Text,
    }


# The most events one history request returns; clients page on with ?after=<last seq>.
HISTORY_PAGE = 5000


def events_after_response(request: Request, events: QuerySet[Any], serializer: type[serializers.Serializer]) -> Response:
    """`?after=SEQ` history of a run's or a deployment's events, in order."""
    try:
        after = int(request.query_params.get("after", 0))
    except ValueError:
        return Response({"after": ["must be an integer"]}, status=400)
    page = events.filter(seq__gt=after).order_by("seq")[:HISTORY_PAGE]
    return Response(serializer(page, many=True).data)


def owned(view: Any, queryset: QuerySet[Any], owner_field: str = "owner") -> QuerySet[Any]:
    """The caller's own objects; no objects while the schema generator inspects the view."""
    if getattr(view, "swagger_fake_view", False):
        return queryset.none()
    return queryset.filter(**{owner_field: view.request.user})
