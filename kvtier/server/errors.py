"""API errors, rendered in the shape each API's official client parses.

OpenAI:    {"error": {"message", "type", "param", "code"}}
Anthropic: {"type": "error", "error": {"type", "message"}}

Every 4xx carries `x-should-retry: false` so the SDKs do not silently resend
a client mistake; 429 / 529 / 5xx leave retrying to the client.
"""

from __future__ import annotations

import json
from enum import Enum

from fastapi.responses import JSONResponse

# Status code -> Anthropic error type (docs.anthropic.com, "Errors").
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
# Status code -> OpenAI error type (what api.openai.com sends).
OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "server_error",
}


def _documented(codes: dict[int, str]) -> dict[int, dict]:
    return {code: {"description": text} for code, text in codes.items()}


# Error statuses each API documents in /openapi.json (bodies in that API's error shape).
OPENAI_ERROR_RESPONSES = _documented({
    400: "invalid request (bad JSON, wrong types, context overflow)", 401: "missing or wrong API key",
    403: "Host header refused (DNS-rebinding guard)", 404: "unknown model", 413: "request body too large",
    429: "server at its request limit", 500: "engine failure"})
ANTHROPIC_ERROR_RESPONSES = _documented({
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 500: "api_error", 529: "overloaded_error"})


# Routes that stream with `"stream": true` answer 200 as JSON or as server-sent events.
STREAMING_200 = {200: {"description": "JSON, or server-sent events when `stream` is true",
                       "content": {"application/json": {}, "text/event-stream": {}}}}
OPENAI_STREAMING_RESPONSES = {**STREAMING_200, **OPENAI_ERROR_RESPONSES}
ANTHROPIC_STREAMING_RESPONSES = {**STREAMING_200, **ANTHROPIC_ERROR_RESPONSES}


class Flavor(str, Enum):
    """Which API's error shape a route answers in."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


class APIError(Exception):
    """A request that cannot be served; `status` is the HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, err_type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type

    def openai_body(self) -> dict:
        etype = self.err_type or OPENAI_TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": etype, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        etype = ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": etype, "message": self.message}}

    def body(self, flavor: Flavor) -> dict:
        return self.anthropic_body() if flavor is Flavor.ANTHROPIC else self.openai_body()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found_model(name: str, available: str) -> APIError:
    return APIError(404, f"The model {name!r} does not exist; this server serves {available!r}",
                    param="model", code="model_not_found")


def overflow_error_from(e: Exception) -> APIError:
    """Prompt + max_tokens past the context: a 400 naming the lengths (the message says them)."""
    return APIError(400, str(e), param="messages", code="context_length_exceeded")


def overloaded(flavor: Flavor) -> APIError:
    msg = "The server is at its request limit; try again shortly"
    if flavor is Flavor.ANTHROPIC:
        return APIError(529, msg)
    return APIError(429, msg, code="rate_limit_exceeded")


def headers_for(status: int) -> dict[str, str]:
    """Client mistakes must not be retried; overload and server faults may be."""
    if 400 <= status < 500 and status not in (408, 409, 429):
        return {"x-should-retry": "false"}
    return {}


def error_response(err: APIError, flavor: Flavor) -> JSONResponse:
    return JSONResponse(err.body(flavor), status_code=err.status, headers=headers_for(err.status))


def flavor_for_path(path: str) -> Flavor:
    """/v1/messages* speaks Anthropic; everything else speaks OpenAI."""
    return Flavor.ANTHROPIC if path.startswith("/v1/messages") else Flavor.OPENAI


def sse_error_data(err: APIError, flavor: Flavor) -> str:
    """A mid-stream error frame: OpenAI `data: {"error":…}`, Anthropic `event: error`."""
    body = json.dumps(err.body(flavor))
    if flavor is Flavor.ANTHROPIC:
        return f"event: error\ndata: {body}\n\n"
    return f"data: {body}\n\n"


def internal_error_frame(flavor: Flavor):
    """SSEResponse's on_error for `flavor`: an unexpected exception mid-stream becomes that API's
    error frame naming only the exception type (no traceback reaches the client)."""
    def frame(e: Exception) -> str:
        return sse_error_data(APIError(500, f"internal error: {type(e).__name__}"), flavor)
    return frame


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """Turn pydantic's error list into one readable line plus the offending param."""
    parts = []
    param = None
    for e in errors[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        param = param or (where if loc else None)
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request body", param
