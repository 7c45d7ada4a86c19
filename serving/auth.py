"""Bearer-token auth for every route but the open ones (`/health`, so a load balancer needs no secret).

The key comes from `PAGODA_API_KEY` only (never a flag, so it never shows in `ps`), and the comparison is
constant-time so response timing does not leak how much of a guess was right.
"""

from __future__ import annotations

import hmac

from flask import Flask, request

from serving.errors import ApiError

OPEN_PATHS = frozenset({"/health"})


def install(app: Flask, api_key: str | None) -> None:
    if not api_key:
        return
    expected = api_key.encode()

    @app.before_request
    def check_bearer() -> None:
        if request.path in OPEN_PATHS:
            return
        # RFC 9110 section 11.1: the scheme name is case-insensitive (`bearer` is as good as `Bearer`).
        scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
        supplied = token.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() != "bearer" or not hmac.compare_digest(supplied, expected):
            raise ApiError(401, "missing or invalid bearer token", "unauthorized", "Authorization",
                           headers={"WWW-Authenticate": "Bearer"})
