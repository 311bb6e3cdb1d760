"""Logs an operator can ship: one JSON object per line (FATHOM_LOG_FORMAT=json) and a request id.

Every HTTP request gets an id (the caller's `X-Request-Id` when it is sane, else a new one),
returned in the response's `X-Request-Id` header and carried by every log line written while the
request is handled, in whatever task or thread (a context variable: asgiref copies it into the
threads that run Django's sync code). The id is set by controlplane.observability's ASGI wrapper.

This module imports nothing of Django or prometheus_client: Django imports it while it applies
LOGGING, before the apps are ready.
"""

from __future__ import annotations

import contextvars
import json
import logging
import logging.config
import re
import uuid
from datetime import UTC, datetime
from typing import Any

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("fathom_request_id", default=None)

# A caller's id is kept only if it could not break a log line or a header, nor flood them:
# UUIDs, ULIDs, hex and dotted trace ids fit.
_SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id_from(incoming: str | None) -> str:
    """The caller's `X-Request-Id` if it is sane, else a fresh one."""
    if incoming and _SANE_REQUEST_ID.fullmatch(incoming):
        return incoming
    return uuid.uuid4().hex


# What every LogRecord has; anything else on a record was passed as `extra=` and is kept.
_RECORD_FIELDS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "color_message"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: time (UTC, ISO 8601), level, logger, message,
    process, request_id (when handling a request), exception (its traceback), and the record's
    `extra=` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
        }
        request_id = REQUEST_ID.get()
        if request_id is not None:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and key not in entry:
                entry[key] = value
        # default=str: an extra that JSON cannot hold is written as text, never lost with the line.
        return json.dumps(entry, default=str, ensure_ascii=False)


# uvicorn sets up these loggers with handlers of its own before it imports the app (and so
# before Django applies LOGGING); uvicorn.access has none when the access log is off.
_UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


def configure(config: dict[str, Any]) -> None:
    """Django's LOGGING_CONFIG: applies LOGGING; in JSON mode also gives the handlers uvicorn
    installed the JSON formatter, and routes Python's warnings through logging, so that every
    line the process writes is one JSON object."""
    logging.config.dictConfig(config)
    if config["handlers"]["console"].get("formatter") != "json":
        return
    formatter = JsonFormatter()
    for name in _UVICORN_LOGGERS:
        for handler in logging.getLogger(name).handlers:
            handler.setFormatter(formatter)
    logging.captureWarnings(True)
