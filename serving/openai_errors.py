"""OpenAI-style errors: every failure a client of `/v1/...` sees has the body

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

with `type` and `code` as OpenAI uses them, so the official clients raise their usual
exception classes (`BadRequestError`, `NotFoundError`, `InternalServerError`, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass
class OpenAIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def body_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()

    def sse_event(self) -> bytes:
        """The error as a final server-sent event, for a stream that breaks after it started."""
        return b"data: " + self.body_bytes() + b"\n\ndata: [DONE]\n\n"


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def model_not_found(model: Any, available: list[str]) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model {model!r} does not exist; available: {', '.join(available) or 'none'}.",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def no_replica_available(model: str) -> OpenAIError:
    return OpenAIError(
        503,
        f"No healthy replica of {model!r} is available right now; retry shortly.",
        "server_error",
        None,
        "no_healthy_replica",
    )


def upstream_failed(detail: str) -> OpenAIError:
    return OpenAIError(502, f"The model server failed: {detail}", "server_error", None, "upstream_error")


def upstream_timeout(seconds: float) -> OpenAIError:
    return OpenAIError(
        504, f"The model server did not answer within {seconds:g} s.", "server_error", None, "upstream_timeout"
    )


_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def normalize_error_body(status: int, raw: bytes) -> bytes:
    """An upstream (vLLM) error body in OpenAI's shape. vLLM already answers
    `{"error": {...}}` but with its own `type` ("BadRequestError") and an integer `code`; the
    message and param are kept, type and code are made OpenAI's. A body that is not JSON becomes
    the message."""
    try:
        data = json.loads(raw)
        error = data["error"] if isinstance(data, dict) and isinstance(data.get("error"), dict) else None
    except (ValueError, UnicodeDecodeError):
        error = None
    if error is None:
        text = raw.decode("utf-8", "replace").strip()[:2000] or f"HTTP {status}"
        error = {"message": text}
    code = error.get("code")
    return OpenAIError(
        status,
        str(error.get("message", "")),
        _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error"),
        error.get("param"),
        code if isinstance(code, str) else None,
    ).body_bytes()
