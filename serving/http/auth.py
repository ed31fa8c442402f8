"""The server's API-key check (`--api-key` / `$JDET_API_KEY`), as a plain ASGI middleware."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi.responses import JSONResponse

from serving.http.protocol import RequestError


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on every path but /health (and /metrics when `open_paths`
    has it): /docs, /redoc and /openapi.json too. A plain ASGI middleware: Starlette's
    `@app.middleware("http")` wraps `receive` so that `request.is_disconnected()` never sees the
    client go away, which the non-streaming handlers rely on to abort abandoned requests."""

    def __init__(self, app: Any, api_key: str, open_paths: tuple[str, ...] = ("/health",)) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                err = RequestError(
                    "missing or wrong API key (Authorization: Bearer ...)",
                    None,
                    401,
                    "invalid_api_key",
                )
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
