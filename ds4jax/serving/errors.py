"""Every HTTP error is OpenAI's JSON shape, ``{"error": {"message", "type", "param", "code"}}``, never a
traceback or an HTML page. `code` is an engine `ErrorCode` value when the engine decided (``prompt_too_long``,
``capacity_exceeded``, ``non_finite``, ...) or one of `ServerCode` for what the HTTP layer decides."""

from __future__ import annotations

import enum

from ds4jax.generation.requests import ErrorCode


class ServerCode(str, enum.Enum):
    UNKNOWN_PARAMETER = "unknown_parameter"  # a body field this server does not know (named in `param`)
    UNSUPPORTED_PARAMETER = "unsupported_parameter"  # a known OpenAI field this server cannot honour (logprobs, ...)
    INVALID_JSON = "invalid_json"
    UNAUTHORIZED = "unauthorized"  # --api-key is set and the bearer token is missing or wrong
    NOT_FOUND = "not_found"  # no such route
    METHOD_NOT_ALLOWED = "method_not_allowed"
    MODEL_NOT_FOUND = "model_not_found"  # `model` names another model than the one served
    BODY_TOO_LARGE = "body_too_large"  # over --max-body-bytes
    QUEUE_FULL = "queue_full"  # over --max-queue waiting requests (429 with Retry-After)
    NOT_READY = "not_ready"  # warming up or shutting down (503)


# the HTTP status of each code, and OpenAI's error `type` for it
_STATUS = {
    ErrorCode.INVALID_REQUEST.value: 400, ErrorCode.PROMPT_TOO_LONG.value: 400,
    ErrorCode.INVALID_SNAPSHOT.value: 400, ErrorCode.CAPACITY_EXCEEDED.value: 429,
    ErrorCode.CANCELLED.value: 503, ErrorCode.MODEL_PARKED.value: 503, ErrorCode.INTERNAL.value: 500,
    ErrorCode.NON_FINITE.value: 500,
    ServerCode.UNKNOWN_PARAMETER.value: 400, ServerCode.UNSUPPORTED_PARAMETER.value: 400,
    ServerCode.INVALID_JSON.value: 400, ServerCode.UNAUTHORIZED.value: 401, ServerCode.NOT_FOUND.value: 404,
    ServerCode.METHOD_NOT_ALLOWED.value: 405, ServerCode.MODEL_NOT_FOUND.value: 404,
    ServerCode.BODY_TOO_LARGE.value: 413, ServerCode.QUEUE_FULL.value: 429, ServerCode.NOT_READY.value: 503,
}


def error_type(status: int) -> str:
    """OpenAI's `type` for a status."""
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    if status == 404:
        return "not_found_error"
    return "invalid_request_error" if status < 500 else "server_error"


class APIError(Exception):
    """An error answer: `code` (an `ErrorCode` or `ServerCode` value), the message, the offending parameter."""

    def __init__(self, code: str | enum.Enum, message: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None):
        self.code = code.value if isinstance(code, enum.Enum) else str(code)
        self.status = _STATUS.get(self.code, 500)
        self.message, self.param, self.headers = message, param, headers or {}
        super().__init__(message)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": error_type(self.status), "param": self.param,
                          "code": self.code}}


def invalid(param: str, message: str) -> APIError:
    return APIError(ErrorCode.INVALID_REQUEST, f"{param}: {message}", param=param)
