"""The OpenAPI schema of the REST API: drf-spectacular's, plus the error answers of each operation.

`make test` fuzzes the API against this schema (tests/platform/test_api_fuzz.py), so it has to
say everything the API can answer: a client generated from it meets no surprise.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.openapi import AutoSchema
from rest_framework.permissions import AllowAny

_ERROR_DETAIL = {
    "type": "object",
    "properties": {"detail": {"type": "string"}},
    "required": ["detail"],
}
# A 400 names each offending field (nested for nested fields: spec.layout.tp), or says `detail`.
_FIELD_ERRORS = {"type": "object", "additionalProperties": {}}
_ERRORS = {
    "400": ("The request names a field with a value that is not allowed; the body says which and why.", _FIELD_ERRORS),
    "401": ("No valid credentials were sent.", _ERROR_DETAIL),
    "403": ("The credentials may not do this (a session without its CSRF token, say).", _ERROR_DETAIL),
    "404": ("No such object among the caller's own.", _ERROR_DETAIL),
    "409": ("The object's state does not allow this change now; the body says which state it is in.", _FIELD_ERRORS),
}


class Schema(AutoSchema):
    """drf-spectacular's schema, plus the error answers each operation can give.

    - 400 wherever a body or a query parameter is read;
    - 401 and 403 wherever credentials are needed;
    - 404 wherever the path names an object;
    - 409 where a view lists the action in `conflict_actions`.
    """

    def _get_response_bodies(self, direction: Any = "response") -> dict[str, Any]:
        responses = super()._get_response_bodies(direction)
        for code in self._error_codes():
            if code not in responses:
                description, schema = _ERRORS[code]
                responses[code] = {"description": description, "content": {"application/json": {"schema": schema}}}
        return responses

    def _error_codes(self) -> list[str]:
        codes = []
        if self.method in ("POST", "PUT", "PATCH") or self._has_query_parameters():
            codes.append("400")
        if not any(isinstance(p, AllowAny) for p in self.view.get_permissions()):
            codes += ["401", "403"]
        if "{" in self.path:
            codes.append("404")
        if getattr(self.view, "action", None) in getattr(self.view, "conflict_actions", ()):
            codes.append("409")
        return codes

    def _has_query_parameters(self) -> bool:
        return any(p.get("in") == "query" for p in self._get_parameters())
