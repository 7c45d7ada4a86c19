"""The one error shape every route answers with: `{"error": {"message", "type", "field"}, "request_id"}`.

Handlers raise `ApiError`; the app turns it (and every werkzeug HTTP error: 404, 405, 413) into that body,
so a client parses failures one way whatever produced them.
"""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str, field: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.field = field
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "field": self.field}}


def invalid(field: str, message: str) -> ApiError:
    """A schema violation: 422 naming the JSON path of the offending field."""
    return ApiError(422, message, "invalid_request", field)


# werkzeug's status codes mapped to the `type` a client switches on.
HTTP_ERROR_TYPES = {
    400: "invalid_json",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    500: "internal_error",
}
