"""Bad input and refused changes, raised by the domain operations and answered in one place.

`services` modules raise `InvalidInput` (a 400 naming the dotted field), `WrongState` (a 409:
the object's state refuses the change) and `Forbidden` (a 403: the caller sees the object but
may not change it); the CLI prints them, and the REST API turns them into
answers here, in DRF's exception handler (REST_FRAMEWORK["EXCEPTION_HANDLER"]), so no view
catches them itself. Each is a `training.field_error.FieldError`, as a run's spec's, a replica's
options' and Slurm's options' errors are: any of them that reaches a view is a 400 naming its field.
"""

from __future__ import annotations

from typing import Any

from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from controlplane.api import Conflict
from training.field_error import FieldError


class InvalidInput(FieldError):
    """Bad input from a user; `field` is the dotted path of the offending value."""


class WrongState(InvalidInput):
    """A change the object's current state does not allow; the API answers 409."""


class Forbidden(Exception):
    """The caller sees the object but may not make this change (a read-only member); the API answers 403."""


def nested_error(field: str, message: str) -> dict[str, Any]:
    """`spec.layout.tp` → {"spec": {"layout": {"tp": [message]}}}, DRF's shape for nested fields."""
    head, _, rest = field.partition(".")
    return {head: nested_error(rest, message) if rest else [message]}


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's handler, after mapping the domain's errors to the API exceptions they mean."""
    if isinstance(exc, Forbidden):
        exc = exceptions.PermissionDenied(str(exc))
    elif isinstance(exc, WrongState):
        exc = Conflict(exc.field, exc.message)
    elif isinstance(exc, FieldError):
        exc = exceptions.ValidationError(nested_error(exc.field, exc.message))
    return drf_exception_handler(exc, context)
