"""Errors in OpenAI's shape: what the ingress reports to a client."""

from __future__ import annotations

__all__ = ["APIError", "error_body", "validation_message"]


class APIError(Exception):
    """An error reported to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after_s = retry_after_s  # sent as Retry-After (a 503 the client should retry)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_message(errors: list[dict], skip: int = 1) -> tuple[str, str | None]:
    """A pydantic validation error's first complaint as a message naming the field, and the
    field (``skip``: leading parts of its location that are not the field's, e.g. "body")."""
    first = errors[0] if errors else {}
    loc = ".".join(str(x) for x in first.get("loc", ())[skip:])
    msg = f"{loc}: {first.get('msg', 'invalid value')}" if loc else str(first.get("msg", "invalid request"))
    return msg, loc or None
