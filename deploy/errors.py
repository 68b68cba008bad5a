"""Errors in OpenAI's shape: what the ingress reports to a client."""

from __future__ import annotations

__all__ = ["APIError", "error_body"]


class APIError(Exception):
    """An error reported to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after_s = retry_after_s  # sent as Retry-After (a 503 the client should retry)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
